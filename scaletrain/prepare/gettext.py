"""Reader for gettext catalogs (compiled ``.mo`` files) as a parallel corpus.

Every translated UI string of a program is an (English, translation) pair. Catalogs come from *roots*,
each a tree with the ``<locale>/LC_MESSAGES/<domain>.mo`` layout somewhere below it:

* an installed Python package (``django``: every ``django/**/locale/<locale>/LC_MESSAGES/*.mo``, core and
  contrib apps, ``django.mo`` and ``djangojs.mo``), the default and the bundled corpus;
* a locale directory (``/usr/share/locale``: glibc, coreutils, gtk, git, postgres, xkeyboard-config, the
  iso-codes name lists, ... in ~150 languages);
* the sets ``system`` (every directory of ``SYSTEM_LOCALE_DIRS`` that exists and holds catalogs) and
  ``packages`` (every installed Python distribution whose files include catalogs, found through
  ``importlib.metadata``).

:func:`read_catalogs` merges any number of roots: per language, every catalog of every root in order,
cleaned by the rules below, deduplicated *across* roots, optionally capped per language. Catalog domains
matching ``exclude_domains`` (shell patterns on the file name without ``.mo``) are skipped: by default the
iso-codes lists of ~7,900 ISO 639-3 language names and ~5,000 ISO 3166-2 subdivision names per
language (``EXCLUDED_DOMAINS``), which would otherwise be a fifth of the system corpus and teach a model
to answer with a name.

The ``.mo`` format is parsed directly (it is tiny and exact, unlike ``.po`` which needs a parser
for escapes, continuation lines and fuzzy flags; ``msgfmt`` has already dropped fuzzy and
untranslated entries).

Locale -> language code
    ``xx`` -> ``xx``; ``xx_YY`` -> ``xx-yy`` (lower case), except the table ``LOCALE_CODES``
    (``zh_Hans``/``zh_CN`` -> ``zh``, ``zh_Hant``/``zh_TW`` -> ``zh-hant``, ``sr_Latn``/``sr@latin`` -> ``sr-latn``),
    so Django's and the system's names of one language meet under one code.
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
    ``too_long``     a side longer than ``max_bytes`` UTF-8 bytes (0 = no limit).
    ``untranslated`` the translation equals the English string (after the steps below).
    ``duplicate``    the same (English, translation) pair was already kept for this language, from any
                     root (e.g. the same string in several catalogs, or in Django and in the system).
    ``over_cap``     (after the merge) beyond ``max_per_lang`` pairs of the language: the kept pairs are
                     those whose English string ranks first by a seeded hash, so capped languages keep
                     the same English strings where they can (more multi-way parallel test sets).
Modifications (counted, not dropped):
    ``accel_stripped`` access-key markers removed: ``(_F)`` / ``(&F)`` groups (CJK style);
                     ``&&`` -> ``&``; a single ``&`` before a letter or digit unless it stands
                     between two capitals (``Q&A``, ``R&D``, ``AT&T`` are kept); a single ``_`` at the
                     start of a word before a letter (``_File``, ``Save _As``; ``snake_case`` is kept).
                     Strings with more than one candidate marker are left alone.
    Message context (msgctxt) is ignored: the pair is kept under its English msgid; identical pairs
    from different contexts are deduplicated.

Splits are decided by a stable hash (sha256) of the English string's *split key* and the seed: the
key (``split_key``) is the string after NFKC, case folding and with every run of non-alphanumeric
characters made one space, so ``Open``, ``Open…`` and ``open:`` land in one split. One English
string (and its near-identical spellings) is therefore in the same split for every language and every
root: no English sentence of the test split is seen in training, in any direction.

Scripts: :func:`dominant_script` names the script of a language's translations from the Unicode
character names of its letters (``Latin``, ``Cyrillic``, ``Han``, ``Kana``, ``Hangul``, ...); ``prepare``
prints and records it per language.
"""
from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import re
import struct
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from scaletrain.errors import ScaletrainError

#: Default translation languages of the bundled corpus (Django's catalogs; English is the pivot and always
#: present). Scripts: Latin (de fr es), Cyrillic (ru), Greek (el), Arabic (ar), Hebrew (he), Devanagari (hi),
#: Han (zh), Japanese (ja), Hangul (ko), Thai (th), Georgian (ka), Myanmar (my).
DEFAULT_LANGS: tuple[str, ...] = ("de", "fr", "es", "ru", "el", "ar", "he", "hi", "zh", "ja", "ko", "th", "ka", "my")

#: Default languages of a merged corpus (``--catalogs``, ``--locale-dir``, several packages): 28 languages in
#: 16 scripts, every one of them also in Django's catalogs (so a machine with only Django still has them all):
#: Latin (de fr es it pt-br pl tr vi), Cyrillic (ru uk bg), Greek (el), Arabic (ar fa), Hebrew (he),
#: Devanagari (hi mr), Bengali (bn), Tamil (ta), Malayalam (ml), Georgian (ka), Armenian (hy), Thai (th),
#: Myanmar (my), Han (zh zh-hant), Japanese (ja, mostly kana), Hangul (ko).
CATALOG_LANGS: tuple[str, ...] = (
    "de", "fr", "es", "it", "pt-br", "pl", "tr", "vi", "ru", "uk", "bg", "el", "ar", "fa", "he", "hi", "mr",
    "bn", "ta", "ml", "ka", "hy", "th", "my", "zh", "zh-hant", "ja", "ko",
)

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

#: The ``system`` catalog set: these directories, where they exist (Debian/Ubuntu and most Linux systems;
#: Ubuntu's language packs put most translations in locale-langpack).
SYSTEM_LOCALE_DIRS: tuple[str, ...] = ("/usr/share/locale", "/usr/share/locale-langpack", "/usr/local/share/locale")
CATALOG_SETS = ("system", "packages")

#: Catalog domains skipped by default: long lists of names (ISO 639-3 languages, ISO 3166-2 subdivisions).
EXCLUDED_DOMAINS: tuple[str, ...] = ("iso_639-3", "iso_639_3", "iso_3166-2", "iso_3166_2")

CLEAN_REASONS = ("plural", "empty", "multiline", "placeholder", "markup", "too_long", "untranslated", "duplicate")
COUNTER_KEYS = ("entries", "kept", "accel_stripped", *CLEAN_REASONS, "over_cap")

_MO_MAGIC_LE = 0x950412DE
_MO_MAGIC_BE = 0xDE120495


def locale_to_code(locale: str) -> str:
    """Map a locale directory name to the stable language code used in manifests."""
    if locale in LOCALE_CODES:
        return LOCALE_CODES[locale]
    base, _, modifier = locale.split(".")[0].partition("@")
    code = base.replace("_", "-").lower()
    # a script modifier keeps its script apart (sr@ijekavianlatin, uz@cyrillic); other modifiers
    # (ca@valencia, sr@ijekavian) are variants of the same written language
    for name, tag in (("latin", "latn"), ("cyrillic", "cyrl")):
        if name in modifier.lower():
            return f"{code}-{tag}"
    return code


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
# finding catalogs: roots (packages, locale directories, the system and packages sets)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CatalogRoot:
    """A tree holding ``<locale>/LC_MESSAGES/*.mo`` files below it, and how the user named it."""

    label: str  # "package:django", "system:/usr/share/locale", "dir:/path"
    root: Path
    version: str | None = None  # the package's version, where it has one

    def to_dict(self) -> dict:
        d = {"label": self.label, "root": str(self.root)}
        if self.version:
            d["version"] = self.version
        return d


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


def package_root(package: str) -> CatalogRoot:
    version = None
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        version = dist_version(package)
    except (ImportError, PackageNotFoundError, ValueError):
        pass  # version metadata is optional (a package on sys.path without a distribution)
    return CatalogRoot(f"package:{package}", package_dir(package), version)


def locale_dir_root(path: str | Path, label_kind: str = "dir") -> CatalogRoot:
    root = Path(path)
    if not root.is_dir():
        raise ScaletrainError(f"locale directory {root} does not exist")
    return CatalogRoot(f"{label_kind}:{root}", root)


def _find_mo(root: Path) -> dict[str, list[Path]]:
    """locale name -> sorted .mo paths, for every ``<locale>/LC_MESSAGES/*.mo`` below root."""
    found: dict[str, list[Path]] = {}
    for p in sorted(root.rglob("*.mo")):
        if p.parent.name != "LC_MESSAGES":
            continue
        found.setdefault(p.parent.parent.name, []).append(p)
    return found


def system_locale_dirs(candidates: Sequence[str] = SYSTEM_LOCALE_DIRS) -> list[Path]:
    """The candidates that exist and hold at least one ``<locale>/LC_MESSAGES/*.mo``."""
    out = []
    for c in candidates:
        p = Path(c)
        if p.is_dir() and next(p.glob("*/LC_MESSAGES/*.mo"), None) is not None:
            out.append(p)
    return out


def catalog_packages() -> list[str]:
    """Top-level import names of installed distributions whose files include gettext catalogs."""
    from importlib.metadata import distributions

    names = set()
    for dist in distributions():
        for f in dist.files or ():
            parts = Path(str(f)).parts
            if f.name.endswith(".mo") and len(parts) > 2 and parts[-2] == "LC_MESSAGES" and parts[0].isidentifier():
                names.add(parts[0])
                break
    return sorted(names)


def resolve_roots(catalogs: Sequence[str] = (), locale_dirs: Sequence[str | Path] = (),
                  packages: Sequence[str] = ()) -> tuple[list[CatalogRoot], list[str]]:
    """The roots named by the catalog sets (``system``, ``packages``), locale directories and packages, in
    that order (system, locale directories, packages), each tree once; and notes on sets that found nothing.
    Nothing named at all means the bundled corpus: the package ``django``."""
    bad = [c for c in catalogs if c not in CATALOG_SETS]
    if bad:
        raise ScaletrainError(f"--catalogs: unknown set(s) {', '.join(bad)}; choose from {', '.join(CATALOG_SETS)} "
                              "(comma-separated)")
    if not (catalogs or locale_dirs or packages):
        packages = ["django"]
    roots: list[CatalogRoot] = []
    notes: list[str] = []
    if "system" in catalogs:
        found = system_locale_dirs()
        roots += [locale_dir_root(p, "system") for p in found]
        if not found:
            notes.append(f"catalog set 'system': no catalogs in {', '.join(SYSTEM_LOCALE_DIRS)}")
    roots += [locale_dir_root(d) for d in locale_dirs]
    pkgs = list(packages)
    if "packages" in catalogs:
        found_pkgs = catalog_packages()
        pkgs = found_pkgs + [p for p in pkgs if p not in found_pkgs]
        if not found_pkgs:
            notes.append("catalog set 'packages': no installed Python package has gettext catalogs")
    roots += [package_root(p) for p in dict.fromkeys(pkgs)]
    unique: dict[Path, CatalogRoot] = {}
    for r in roots:
        unique.setdefault(r.root.resolve(), r)
    return list(unique.values()), notes


def _domain_excluded(path: Path, exclude_domains: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(path.stem, pat) for pat in exclude_domains)


def catalogs_by_lang(roots: Sequence[CatalogRoot], exclude_domains: Sequence[str] = EXCLUDED_DOMAINS
                     ) -> tuple[dict[str, list[tuple[int, Path]]], Counter]:
    """Language code -> [(root index, catalog path)] in root order, then sorted path order (English
    locales excluded); and per root label the number of catalogs skipped by ``exclude_domains``."""
    out: dict[str, list[tuple[int, Path]]] = {}
    excluded: Counter = Counter()
    for i, r in enumerate(roots):
        by_locale = _find_mo(r.root)
        for loc in sorted(by_locale):
            if _is_english(loc):
                continue
            for p in by_locale[loc]:
                if _domain_excluded(p, exclude_domains):
                    excluded[r.label] += 1
                else:
                    out.setdefault(locale_to_code(loc), []).append((i, p))
    return {k: out[k] for k in sorted(out)}, excluded


def single_root(package: str = "django", locale_dir: str | Path | None = None) -> CatalogRoot:
    return locale_dir_root(locale_dir) if locale_dir is not None else package_root(package)


def find_catalogs(package: str = "django", locale_dir: str | Path | None = None) -> dict[str, list[Path]]:
    """Language code -> catalog paths of one package or locale directory (English locales excluded)."""
    root = single_root(package, locale_dir)
    found, _ = catalogs_by_lang([root], ())
    if not found:
        raise ScaletrainError(_no_catalogs([root]))
    return {lang: [p for _, p in v] for lang, v in found.items()}


def _no_catalogs(roots: Sequence[CatalogRoot]) -> str:
    where = ", ".join(f"{r.label} ({r.root})" if not r.label.endswith(str(r.root)) else r.label for r in roots)
    return f"{where or 'no catalog roots'}: no gettext catalogs (expected <locale>/LC_MESSAGES/*.mo files below it)"


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


def clean_pair(en: str, xx: str, max_bytes: int = 0) -> tuple[str | None, str, str]:
    """Apply the rules to one pair: returns (reason or None if kept, en, xx) after modification.
    ``max_bytes`` > 0: a side longer than that many UTF-8 bytes is ``too_long``."""
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
    if max_bytes and max(len(en2.encode("utf-8")), len(xx2.encode("utf-8"))) > max_bytes:
        return "too_long", en2, xx2
    reason = "accel_stripped" if (en2, xx2) != (en, xx) else ""
    if en2 == xx2:
        return "untranslated", en2, xx2
    return (reason or None), en2, xx2


# ---------------------------------------------------------------------------------------------
# the merged corpus
# ---------------------------------------------------------------------------------------------
@dataclass
class GettextCorpus:
    langs: list[str]  # translation languages, in the requested order
    pairs: dict[str, list[tuple[str, str]]]  # lang -> [(english, translation)], root then catalog order
    counters: dict[str, dict[str, int]]  # lang -> reason -> count (plus "entries", "kept")
    source: dict  # description for the manifest
    per_source: dict[str, dict[str, int]] = field(default_factory=dict)  # root label -> reason -> count
    scripts: dict[str, str] = field(default_factory=dict)  # lang -> dominant script of its translations
    notes: list[str] = field(default_factory=list)  # roots or default languages that were not found

    def total_counters(self) -> dict[str, int]:
        tot: Counter = Counter()
        for c in self.counters.values():
            tot.update(c)
        return dict(tot)


def _new_counter() -> Counter:
    return Counter({k: 0 for k in COUNTER_KEYS})


def pairs_from_entries(entries: Iterable[MoEntry], counters: Counter, seen: set,
                       max_bytes: int = 0) -> list[tuple[str, str]]:
    kept = []
    for e in entries:
        if e.msgid == "" and e.context is None:
            continue  # header
        counters["entries"] += 1
        if e.msgid_plural is not None:
            counters["plural"] += 1
            continue
        reason, en, xx = clean_pair(e.msgid, e.msgstrs[0] if e.msgstrs else "", max_bytes)
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


def _choose_langs(available: Sequence[str], langs: Sequence[str] | None, default_langs: Sequence[str],
                  roots: Sequence[CatalogRoot]) -> tuple[list[str], list[str]]:
    """The languages to read and notes: ``langs`` (every one must be available; ``["all"]`` = every code
    found), else the defaults that are available (the others noted)."""
    if langs is not None and list(langs) == ["all"]:
        return list(available), []
    if langs is None:
        chosen = [l for l in default_langs if l in available]
        missing = [l for l in default_langs if l not in available]
        if not chosen:
            raise ScaletrainError(f"{_where(roots)}: none of the default languages ({', '.join(default_langs)}) has "
                                  f"catalogs; choose with --langs from: {', '.join(available)}")
        return chosen, ([f"default languages without catalogs here, left out: {', '.join(missing)}"] if missing else [])
    langs = list(langs)
    if not langs:
        raise ScaletrainError("no languages requested")
    if len(set(langs)) != len(langs):
        raise ScaletrainError(f"duplicate language codes requested: {langs}")
    if PIVOT in langs:
        raise ScaletrainError(f"{PIVOT!r} is the pivot language of gettext corpora; do not list it in langs")
    unknown = [l for l in langs if l not in available]
    if unknown:
        raise ScaletrainError(f"no gettext catalogs for language(s) {', '.join(unknown)} in {_where(roots)}; "
                              f"available codes: {', '.join(available)}")
    return langs, []


def _where(roots: Sequence[CatalogRoot]) -> str:
    return ", ".join(r.label for r in roots)


def _read_lang(files: Sequence[tuple[int, Path]], roots: Sequence[CatalogRoot], max_bytes: int,
               per_source: dict[str, Counter]) -> tuple[list[tuple[str, str]], list[int], Counter]:
    """Every catalog of one language in order: its pairs, the root index of each, its counters (and each
    root's share added to ``per_source``)."""
    c = _new_counter()
    seen: set = set()
    pairs: list[tuple[str, str]] = []
    origin: list[int] = []
    for i, path in files:
        before = Counter(c)
        got = pairs_from_entries(read_mo(path), c, seen, max_bytes)
        pairs += got
        origin += [i] * len(got)
        delta = Counter(c)
        delta.subtract(before)
        per_source[roots[i].label].update(delta)
        per_source[roots[i].label]["catalogs"] += 1
    return pairs, origin, c


def cap_pairs(pairs: Sequence[tuple[str, str]], cap: int, seed: int = 0) -> list[int]:
    """Indices (ascending) of the ``cap`` pairs whose English split key ranks first by a seeded sha256 (then
    the translation): capped languages keep the same English strings where they can."""
    if cap <= 0 or len(pairs) <= cap:
        return list(range(len(pairs)))

    def rank(i: int):
        en, xx = pairs[i]
        return hashlib.sha256(f"cap\x00{seed}\x00{split_key(en)}".encode("utf-8")).digest(), en, xx

    return sorted(sorted(range(len(pairs)), key=rank)[:cap])


def read_catalogs(
    roots: Sequence[CatalogRoot],
    langs: Sequence[str] | None = None,
    *,
    default_langs: Sequence[str] = CATALOG_LANGS,
    exclude_domains: Sequence[str] = EXCLUDED_DOMAINS,
    max_per_lang: int = 0,
    max_bytes: int = 0,
    seed: int = 0,
) -> GettextCorpus:
    """Read, clean, merge and deduplicate the catalogs of every root for the chosen languages (module doc).

    ``langs``: codes (each must have catalogs in some root), ``["all"]`` for every code found, or None for
    the ``default_langs`` that have catalogs here. ``max_per_lang`` > 0 caps each language's pairs
    (``over_cap``); ``max_bytes`` > 0 drops pairs with a longer side (``too_long``).
    """
    if max_per_lang < 0 or max_bytes < 0:
        raise ScaletrainError(f"max_per_lang ({max_per_lang}) and max_bytes ({max_bytes}) must be >= 0 (0 = no limit)")
    roots = list(roots)
    found, excluded = catalogs_by_lang(roots, exclude_domains)
    if not found:
        raise ScaletrainError(_no_catalogs(roots))
    chosen, notes = _choose_langs(list(found), langs, default_langs, roots)
    per_source: dict[str, Counter] = {r.label: Counter({"catalogs": 0, **_new_counter()}) for r in roots}
    for label, n in excluded.items():
        per_source[label]["excluded_catalogs"] = n
    pairs: dict[str, list[tuple[str, str]]] = {}
    counters: dict[str, dict[str, int]] = {}
    for lang in chosen:
        got, origin, c = _read_lang(found[lang], roots, max_bytes, per_source)
        keep = cap_pairs(got, max_per_lang, seed)
        if len(keep) < len(got):
            kept = set(keep)
            for j in range(len(got)):
                if j not in kept:
                    per_source[roots[origin[j]].label].update({"over_cap": 1, "kept": -1})
            c["over_cap"] = len(got) - len(keep)
            c["kept"] = len(keep)
            got = [got[j] for j in keep]
        pairs[lang] = got
        counters[lang] = dict(c)
    source = {
        "type": "gettext",
        "roots": [r.to_dict() for r in roots],
        "exclude_domains": list(exclude_domains),
        "max_per_lang": max_per_lang,
        "max_bytes": max_bytes,
        "catalogs": {l: [_catalog_name(roots, i, p) for i, p in found[l]] for l in chosen},
    }
    scripts = {l: dominant_script(xx for _, xx in pairs[l]) for l in chosen}
    return GettextCorpus(chosen, pairs, counters, source, {k: dict(v) for k, v in per_source.items()}, scripts, notes)


def _catalog_name(roots: Sequence[CatalogRoot], i: int, path: Path) -> str:
    """A catalog's path relative to its root, prefixed with the root's label when there are several roots."""
    rel = str(path.relative_to(roots[i].root))
    return rel if len(roots) == 1 else f"{roots[i].label}//{rel}"


def read_gettext(
    package: str = "django", langs: Sequence[str] | None = None, locale_dir: str | Path | None = None
) -> GettextCorpus:
    """One package's (or one locale directory's) catalogs for ``langs`` (default ``DEFAULT_LANGS``, every one
    required); :func:`read_catalogs` with that single root."""
    return read_catalogs([single_root(package, locale_dir)], list(DEFAULT_LANGS if langs is None else langs))


# ---------------------------------------------------------------------------------------------
# scripts
# ---------------------------------------------------------------------------------------------
_SCRIPT_WORDS = {"CJK": "Han", "HIRAGANA": "Kana", "KATAKANA": "Kana", "HANGUL": "Hangul"}


def char_script(ch: str) -> str | None:
    """The script of a letter from its Unicode name (``LATIN SMALL LETTER A`` -> ``Latin``); None for
    anything else (digits, punctuation, symbols, marks)."""
    if not unicodedata.category(ch).startswith("L"):
        return None
    name = unicodedata.name(ch, "")
    word = name.split(" ", 1)[0]
    if word in ("FULLWIDTH", "HALFWIDTH"):
        word = name.split(" ", 2)[1] if name.count(" ") >= 1 else word
    if word in _SCRIPT_WORDS:
        return _SCRIPT_WORDS[word]
    return word.capitalize() if word else None


def dominant_script(texts: Iterable[str], max_chars: int = 200_000) -> str:
    """The script of most letters in ``texts`` (the first ``max_chars`` letters), Latin counted only when no
    other script has a fifth of the letters (UI translations keep Latin product names and commands); a
    Japanese text is ``Kana`` when a tenth of its letters are kana (else its Han letters make it ``Han``)."""
    n: Counter = Counter()
    total = 0
    for t in texts:
        for ch in t:
            s = char_script(ch)
            if s:
                n[s] += 1
                total += 1
        if total >= max_chars:
            break
    if not total:
        return "none"
    if n["Kana"] >= 0.1 * total:
        return "Kana"
    other = [(k, v) for k, v in n.most_common() if k != "Latin"]
    if other and other[0][1] >= 0.2 * total:
        return other[0][0]
    return n.most_common(1)[0][0]


# ---------------------------------------------------------------------------------------------
# splits
# ---------------------------------------------------------------------------------------------
def split_key(english: str) -> str:
    """What decides an English string's split: NFKC, case folded, every run of characters other than
    letters and digits one space (``Open…`` and ``open:`` -> ``open``); the folded string itself when
    nothing alphanumeric is left."""
    s = unicodedata.normalize("NFKC", english).casefold()
    key = " ".join("".join(ch if ch.isalnum() else " " for ch in s).split())
    return key or s


def split_of(english: str, valid_frac: float = 0.05, test_frac: float = 0.05, seed: int = 0) -> str:
    """'train' / 'valid' / 'test' from a stable hash of a string (prepare hashes ``split_key(english)``, so
    one English string is in one split for every language and every root)."""
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
