"""Reader for gettext catalogs (compiled ``.mo`` files) as a parallel corpus.

Every translated UI string of a package is an (English, translation) pair. The default source is
the catalogs bundled with an installed Python package (``django``): every file matching
``<package>/**/locale/<locale>/LC_MESSAGES/<domain>.mo`` (django core *and* its contrib apps, both
``django.mo`` and ``djangojs.mo``). Any other tree with the same ``<locale>/LC_MESSAGES/*.mo``
layout (e.g. ``/usr/share/locale``) can be read with ``locale_dir=``.

The ``.mo`` format is parsed directly (it is tiny and exact, unlike ``.po`` which needs a parser
for escapes, continuation lines and fuzzy flags; ``msgfmt`` has already dropped fuzzy and
untranslated entries).

Locale -> language code
    ``xx`` -> ``xx``; ``xx_YY`` -> ``xx-yy`` (lower case), except the table ``LOCALE_CODES``
    (``zh_Hans`` -> ``zh``, ``zh_Hant`` -> ``zh-hant``, ``sr_Latn`` -> ``sr-latn``).
    English locales (``en``, ``en_GB``, ...) are the pivot, never a translation language.
    Codes are stable: they depend only on the locale directory name.

Cleaning rules, applied in this order; the first rule that fires is counted under its name:
    ``plural``       plural entries (msgid_plural): forms are number-dependent and nearly all carry a
                     count placeholder; dropped deliberately.
    ``empty``        either side empty after stripping surrounding whitespace (and the header).
    ``multiline``    either side contains a line break (after stripping surrounding whitespace).
    ``placeholder``  printf (``%s``, ``%d``, ``%(name)s``, ``%.2f``) or brace (``{name}``, ``{0}``,
                     ``{}``) placeholders on either side.
    ``markup``       an HTML/XML tag (``<b>``, ``</a>``, ``<br/>``) or an entity (``&amp;``, ``&#39;``).
    ``untranslated`` the translation equals the English string (after the steps below).
    ``duplicate``    the same (English, translation) pair was already kept for this language
                     (e.g. the same string in several catalogs).
Modifications (counted, not dropped):
    ``accel_stripped`` access-key markers removed: ``(_F)`` / ``(&F)`` groups (CJK style);
                     ``&&`` -> ``&``; a single ``&`` before a letter or digit unless it stands
                     between two capitals (``Q&A``, ``R&D``, ``AT&T`` are kept); a single ``_`` at the
                     start of a word before a letter (``_File``, ``Save _As``; ``snake_case`` is kept).
                     Strings with more than one candidate marker are left alone.
    Message context (msgctxt) is ignored: the pair is kept under its English msgid; identical pairs
    from different contexts are deduplicated.

Splits are decided by a stable hash (sha256) of the English string and the seed, so one English
string lands in the same split for every language.
"""
from __future__ import annotations

import hashlib
import importlib.util
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from scaletrain.errors import ScaletrainError

#: Default translation languages (English is the pivot and always present). Scripts: Latin (de fr es),
#: Cyrillic (ru), Greek (el), Arabic (ar), Hebrew (he), Devanagari (hi), Han (zh), Japanese (ja),
#: Hangul (ko), Thai (th), Georgian (ka), Myanmar (my).
DEFAULT_LANGS: tuple[str, ...] = ("de", "fr", "es", "ru", "el", "ar", "he", "hi", "zh", "ja", "ko", "th", "ka", "my")

PIVOT = "en"

#: Locale directory names whose code is not the generic ``xx`` / ``xx-yy`` rule.
LOCALE_CODES: dict[str, str] = {
    "zh_Hans": "zh",
    "zh_Hant": "zh-hant",
    "zh_CN": "zh",
    "zh_TW": "zh-hant",
    "sr_Latn": "sr-latn",
    "sr@latin": "sr-latn",
}

CLEAN_REASONS = ("plural", "empty", "multiline", "placeholder", "markup", "untranslated", "duplicate")

_MO_MAGIC_LE = 0x950412DE
_MO_MAGIC_BE = 0xDE120495


def locale_to_code(locale: str) -> str:
    """Map a locale directory name to the stable language code used in manifests."""
    if locale in LOCALE_CODES:
        return LOCALE_CODES[locale]
    base = locale.split(".")[0].split("@")[0]
    return base.replace("_", "-").lower()


def _is_english(locale: str) -> bool:
    return locale == "en" or locale.startswith("en_") or locale.startswith("en@")


# ---------------------------------------------------------------------------------------------
# .mo parsing
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEntry:
    context: str | None
    msgid: str
    msgid_plural: str | None
    msgstrs: tuple[str, ...]


def read_mo(path: str | Path) -> list[MoEntry]:
    """Parse a compiled gettext catalog; corrupt files raise ScaletrainError naming the file."""
    path = Path(path)
    try:
        buf = path.read_bytes()
    except OSError as e:
        raise ScaletrainError(f"cannot read gettext catalog {path}: {e}") from None
    if len(buf) < 20:
        raise ScaletrainError(f"{path}: not a gettext .mo file (only {len(buf)} bytes)")
    (magic,) = struct.unpack("<I", buf[:4])
    if magic == _MO_MAGIC_LE:
        end = "<"
    elif magic == _MO_MAGIC_BE:
        end = ">"
    else:
        raise ScaletrainError(f"{path}: not a gettext .mo file (bad magic 0x{magic:08x})")
    _version, n, o_orig, o_trans = struct.unpack(end + "4I", buf[4:20])
    if o_orig + 8 * n > len(buf) or o_trans + 8 * n > len(buf):
        raise ScaletrainError(f"{path}: truncated .mo file (string tables past end of file)")

    def strings(table: int) -> list[bytes]:
        out = []
        for i in range(n):
            length, off = struct.unpack_from(end + "2I", buf, table + 8 * i)
            if off + length > len(buf):
                raise ScaletrainError(f"{path}: truncated .mo file (string {i} past end of file)")
            out.append(buf[off : off + length])
        return out

    origs, trans = strings(o_orig), strings(o_trans)
    charset = "utf-8"
    for o, t in zip(origs, trans):
        if o == b"":
            m = re.search(rb"charset=([A-Za-z0-9_.:-]+)", t)
            if m:
                charset = m.group(1).decode("ascii")
            break
    entries = []
    for o, t in zip(origs, trans):
        try:
            os_, ts = o.decode(charset), t.decode(charset)
        except (UnicodeDecodeError, LookupError) as e:
            raise ScaletrainError(f"{path}: cannot decode catalog strings as {charset}: {e}") from None
        ctx = None
        if "\x04" in os_:
            ctx, os_ = os_.split("\x04", 1)
        ids = os_.split("\x00")
        entries.append(MoEntry(ctx, ids[0], ids[1] if len(ids) > 1 else None, tuple(ts.split("\x00"))))
    return entries


# ---------------------------------------------------------------------------------------------
# finding catalogs
# ---------------------------------------------------------------------------------------------
def package_dir(package: str) -> Path:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ScaletrainError(f"Python package {package!r} is not installed; install it or choose another --package")
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    if spec.origin:
        return Path(spec.origin).parent
    raise ScaletrainError(f"cannot locate the files of package {package!r}")


def _find_mo(root: Path) -> dict[str, list[Path]]:
    """locale name -> sorted .mo paths, for every ``<locale>/LC_MESSAGES/*.mo`` below root."""
    found: dict[str, list[Path]] = {}
    for p in sorted(root.rglob("*.mo")):
        if p.parent.name != "LC_MESSAGES":
            continue
        found.setdefault(p.parent.parent.name, []).append(p)
    return found


def find_catalogs(package: str = "django", locale_dir: str | Path | None = None) -> dict[str, list[Path]]:
    """Language code -> catalog paths (English locales excluded), in sorted path order."""
    if locale_dir is not None:
        root = Path(locale_dir)
        if not root.is_dir():
            raise ScaletrainError(f"locale directory {root} does not exist")
        where = f"locale directory {root}"
    else:
        root = package_dir(package)
        where = f"package {package!r} ({root})"
    by_locale = _find_mo(root)
    out: dict[str, list[Path]] = {}
    for loc in sorted(by_locale):
        if _is_english(loc):
            continue
        out.setdefault(locale_to_code(loc), []).extend(by_locale[loc])
    if not out:
        raise ScaletrainError(
            f"{where} has no gettext catalogs (expected <locale>/LC_MESSAGES/*.mo files below it)"
        )
    return out


def available_langs(package: str = "django", locale_dir: str | Path | None = None) -> list[str]:
    return sorted(find_catalogs(package, locale_dir))


# ---------------------------------------------------------------------------------------------
# cleaning
# ---------------------------------------------------------------------------------------------
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0+]*(?:\d+|\*)?(?:\.(?:\d+|\*))?[sdifFeEgGxXocrub]")
_BRACE = re.compile(r"\{[^{}\s]*\}")
_TAG = re.compile(r"</?[A-Za-z!][^<>]*>")
_ENTITY = re.compile(r"&(?:[A-Za-z][A-Za-z0-9]*|#[0-9]+|#[xX][0-9A-Fa-f]+);")
_ACCEL_GROUP = re.compile(r"\s*\((?:_|&)[^\W_]\)")
_AMP = re.compile(r"(?<!&)&(?!&)(?=[^\W_])")
_UNDERSCORE = re.compile(r"(?:(?<=^)|(?<=[\s(\"'\[]))_(?=[^\W\d_])")


def has_placeholder(s: str) -> bool:
    return bool(_PRINTF.search(s) or _BRACE.search(s))


def has_markup(s: str) -> bool:
    return bool(_TAG.search(s) or _ENTITY.search(s))


def strip_accelerators(s: str) -> str:
    """Remove UI access-key markers (see module doc for the rule)."""
    t = _ACCEL_GROUP.sub("", s)
    amps = [m for m in _AMP.finditer(t)]
    if len(amps) == 1:
        i = amps[0].start()
        between_caps = i > 0 and t[i - 1].isupper() and t[i + 1].isupper()
        if not between_caps:
            t = t[:i] + t[i + 1 :]
    t = t.replace("&&", "&")
    unders = [m for m in _UNDERSCORE.finditer(t)]
    if len(unders) == 1:
        i = unders[0].start()
        t = t[:i] + t[i + 1 :]
    return t


def clean_pair(en: str, xx: str) -> tuple[str | None, str, str]:
    """Apply the rules to one pair: returns (reason or None if kept, en, xx) after modification."""
    en, xx = en.strip(), xx.strip()
    if not en or not xx:
        return "empty", en, xx
    if any(c in s for s in (en, xx) for c in "\n\r\u2028\u2029"):
        return "multiline", en, xx
    if has_placeholder(en) or has_placeholder(xx):
        return "placeholder", en, xx
    if has_markup(en) or has_markup(xx):
        return "markup", en, xx
    en2, xx2 = strip_accelerators(en).strip(), strip_accelerators(xx).strip()
    if not en2 or not xx2:
        return "empty", en2, xx2
    reason = "accel_stripped" if (en2, xx2) != (en, xx) else ""
    if en2 == xx2:
        return "untranslated", en2, xx2
    return (reason or None), en2, xx2


@dataclass
class GettextCorpus:
    langs: list[str]  # translation languages, in the requested order
    pairs: dict[str, list[tuple[str, str]]]  # lang -> [(english, translation)], catalog order
    counters: dict[str, dict[str, int]]  # lang -> reason -> count (plus "entries", "kept")
    source: dict  # description for the manifest

    def total_counters(self) -> dict[str, int]:
        tot: Counter = Counter()
        for c in self.counters.values():
            tot.update(c)
        return dict(tot)


def pairs_from_entries(entries: Iterable[MoEntry], counters: Counter, seen: set) -> list[tuple[str, str]]:
    kept = []
    for e in entries:
        if e.msgid == "" and e.context is None:
            continue  # header
        counters["entries"] += 1
        if e.msgid_plural is not None:
            counters["plural"] += 1
            continue
        reason, en, xx = clean_pair(e.msgid, e.msgstrs[0] if e.msgstrs else "")
        if reason not in (None, "accel_stripped"):
            counters[reason] += 1
            continue
        if (en, xx) in seen:
            counters["duplicate"] += 1
            continue
        if reason == "accel_stripped":
            counters["accel_stripped"] += 1
        seen.add((en, xx))
        counters["kept"] += 1
        kept.append((en, xx))
    return kept


def read_gettext(
    package: str = "django", langs: Sequence[str] | None = None, locale_dir: str | Path | None = None
) -> GettextCorpus:
    """Read and clean every catalog of the requested languages (default ``DEFAULT_LANGS``)."""
    catalogs = find_catalogs(package, locale_dir)
    langs = list(DEFAULT_LANGS if langs is None else langs)
    if not langs:
        raise ScaletrainError("no languages requested")
    if len(set(langs)) != len(langs):
        raise ScaletrainError(f"duplicate language codes requested: {langs}")
    unknown = [l for l in langs if l not in catalogs]
    if unknown:
        where = f"locale directory {locale_dir}" if locale_dir is not None else f"package {package!r}"
        raise ScaletrainError(
            f"no gettext catalogs for language(s) {', '.join(unknown)} in {where}; "
            f"available codes: {', '.join(sorted(catalogs))}"
        )
    if PIVOT in langs:
        raise ScaletrainError(f"{PIVOT!r} is the pivot language of gettext corpora; do not list it in langs")
    pairs: dict[str, list[tuple[str, str]]] = {}
    counters: dict[str, dict[str, int]] = {}
    for lang in langs:
        c: Counter = Counter({k: 0 for k in ("entries", "kept", "accel_stripped", *CLEAN_REASONS)})
        seen: set = set()
        out: list[tuple[str, str]] = []
        for path in catalogs[lang]:
            out.extend(pairs_from_entries(read_mo(path), c, seen))
        pairs[lang] = out
        counters[lang] = dict(c)
    root = str(locale_dir) if locale_dir is not None else str(package_dir(package))
    source = {"type": "gettext", "package": None if locale_dir is not None else package, "root": root}
    if locale_dir is None:
        try:
            from importlib.metadata import version

            source["package_version"] = version(package)
        except Exception:  # noqa: BLE001 - version metadata is optional
            pass
    source["catalogs"] = {l: [str(Path(p).relative_to(root)) for p in catalogs[l]] for l in langs}
    return GettextCorpus(langs, pairs, counters, source)


# ---------------------------------------------------------------------------------------------
# splits
# ---------------------------------------------------------------------------------------------
def split_of(english: str, valid_frac: float = 0.05, test_frac: float = 0.05, seed: int = 0) -> str:
    """'train' / 'valid' / 'test' from a stable hash of the English side (same for every language)."""
    h = hashlib.sha256(f"{seed}\x00{english}".encode("utf-8")).digest()
    u = int.from_bytes(h[:8], "little") / 2.0**64
    if u < valid_frac:
        return "valid"
    if u < valid_frac + test_frac:
        return "test"
    return "train"


def check_fracs(valid_frac: float, test_frac: float) -> None:
    if not (0 <= valid_frac < 1 and 0 <= test_frac < 1 and valid_frac + test_frac < 1):
        raise ScaletrainError(
            f"valid_frac={valid_frac} and test_frac={test_frac} must be in [0, 1) with a sum below 1"
        )
