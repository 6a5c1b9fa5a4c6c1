"""Stopping a hypothesis at invalid UTF-8 while decoding: the automaton, on the device for beam search
(:class:`Utf8Guard`) and on the host for greedy decoding (:class:`HostUtf8Guard`).

Invalid UTF-8 stops a hypothesis (``stop_invalid_utf8``, on in :func:`translate_examples`, the path of
``evaluate``, ``translate`` and the in-training BLEU): a byte that no continuation can turn into valid UTF-8
(a stray continuation byte, an overlong or surrogate lead, a lead byte where a continuation is due, a
subword piece inside an unfinished character) ends the hypothesis *before* that byte, trimmed back to its
last complete character, and marks it ``cut``. Greedy: the row is finished there. Beam search: such a
candidate is handled like an EOS candidate (it never continues as a beam; ranked inside the top ``beam`` it
is finalised, once per beam, counted towards the sentence's ``beam`` finished hypotheses; a sentence whose
beams are all cut is finished), but a cut hypothesis ranks below
every hypothesis that ended with EOS, so the result is cut only when no beam reached EOS. While no
candidate among the top ``2*beam`` is invalid nothing changes: scores, beams and results are those of the
search without the check, bit for bit (tested). An untrained model writes invalid bytes within a few steps
and so no longer decodes to the length limit: 1.1 s per sentence on CPU before this (a 30-step model).
The check is a per-row state of an 8-state automaton (character boundary, or the continuation bytes still
due with the allowed range of the next byte) advanced by one table lookup per candidate on the device; no
host sync is added. An EOS inside an unfinished character is not a
cut (the sentence ended; the decoder counts the broken sequence as invalid, as before).
"""
from __future__ import annotations

import torch

from scaletrain.vocab import BYTE_OFFSET, EOS


def _utf8_tables() -> torch.Tensor:
    """[3, 256] int64: for each byte as the first byte of a character, the continuation bytes it needs (-1:
    it cannot start a character: 0x80-0xBF, 0xC0, 0xC1, 0xF5-0xFF) and the range [lo, hi] of the next byte
    (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF)."""
    t = torch.full((3, 256), -1, dtype=torch.int64)
    t[0, :0x80] = 0
    for first, last, need, lo, hi in ((0xC2, 0xDF, 1, 0x80, 0xBF), (0xE0, 0xE0, 2, 0xA0, 0xBF),
                                      (0xE1, 0xEC, 2, 0x80, 0xBF), (0xED, 0xED, 2, 0x80, 0x9F),
                                      (0xEE, 0xEF, 2, 0x80, 0xBF), (0xF0, 0xF0, 3, 0x90, 0xBF),
                                      (0xF1, 0xF3, 3, 0x80, 0xBF), (0xF4, 0xF4, 3, 0x80, 0x8F)):
        t[:, first : last + 1] = torch.tensor([need, lo, hi]).unsqueeze(1)
    return t


_UTF8 = _utf8_tables()


def _utf8_automaton() -> list[list[int]]:
    """The UTF-8 checker as a table: ``next[state][token]`` is the state after ``token`` or -1 where the token
    makes the output invalid. State 0 is a character boundary; the others are (continuation bytes still due,
    allowed range [lo, hi] of the next byte), as :func:`_utf8_tables` gives them for each first byte. Columns:
    the ids up to the last byte (``BYTE_OFFSET + 255``), then one for every id past the bytes (a subword
    piece: whole characters, so only at a boundary). EOS is always allowed (the state after it is 0)."""
    lead = [tuple(int(x) for x in _UTF8[:, b]) for b in range(256)]
    states = [(0, 0, 0)] + sorted({x for x in lead if x[0] > 0} | {(n, 0x80, 0xBF) for n in (1, 2)})
    index = {st: i for i, st in enumerate(states)}
    table = []
    for need, lo, hi in states:
        row = [0 if need == 0 else -1] * (BYTE_OFFSET + 257)  # ids below the bytes and past them
        for b in range(256):
            if need == 0:
                row[BYTE_OFFSET + b] = index[lead[b]] if lead[b][0] > 0 else lead[b][0]  # ASCII 0, no lead -1
            else:
                row[BYTE_OFFSET + b] = (index[(need - 1, 0x80, 0xBF)] if need > 1 else 0) if lo <= b <= hi else -1
        row[EOS] = 0
        table.append(row)
    return table


_UTF8_NEXT = _utf8_automaton()
_UTF8_COLUMNS = BYTE_OFFSET + 257


class Utf8Guard:
    """UTF-8 state of each decoder row (a state of :func:`_utf8_automaton`; 0 = at a character boundary), on
    the device: one table lookup per candidate, no host sync."""

    def __init__(self, rows: int, device, beams: int = 1):
        self.table = torch.tensor(_UTF8_NEXT, dtype=torch.int64, device=device)
        self.state = torch.zeros(rows, dtype=torch.int64, device=device)
        # [i, j]: rank i comes before rank j among a sentence's top ``beams`` candidates (_guard_candidates)
        self.earlier = torch.ones((beams, beams), dtype=torch.bool, device=device).triu(1)

    def next(self, rows: torch.Tensor | None, tokens: torch.Tensor):
        """For ``tokens`` following the rows ``rows`` (None: row i for token i): whether each keeps the output
        valid UTF-8 (EOS: True), and the state after it (shaped like ``tokens``)."""
        return self.after(self.state if rows is None else self.state[rows], tokens)

    def after(self, state: torch.Tensor, tokens: torch.Tensor):
        """Whether each of ``tokens`` keeps valid the row in ``state`` it follows, and the state after it."""
        nxt = self.table[state, tokens.clamp(max=_UTF8_COLUMNS - 1)]
        return nxt >= 0, nxt.clamp(min=0)


class HostUtf8Guard:
    """The same automaton on the host, for greedy decoding, which already brings each step's tokens to the
    host: a list lookup per row instead of tensor ops per step."""

    def __init__(self, rows: int):
        self.state = [0] * rows  # per live row

    def advance(self, tokens: list[int], status: list[int]) -> None:
        """In place: ``status`` 2 for a row whose token makes it invalid UTF-8 (0 = continues, 1 = EOS)."""
        for r, tok in enumerate(tokens):
            if status[r]:
                continue
            nxt = _UTF8_NEXT[self.state[r]][min(tok, _UTF8_COLUMNS - 1)]
            if nxt < 0:
                status[r] = 2
            else:
                self.state[r] = nxt

    def keep(self, rows: list[int]) -> None:
        self.state = [self.state[r] for r in rows]


def complete_prefix(tokens: list[int]) -> list[int]:
    """A valid UTF-8 prefix (as the guard keeps it) without its trailing unfinished character: a lead byte
    followed by fewer continuation bytes than it needs. Ids that are not bytes are whole characters."""
    k = j = len(tokens)
    while j > 0 and k - j < 3 and 0x80 <= tokens[j - 1] - BYTE_OFFSET <= 0xBF:
        j -= 1  # the continuation bytes at the end
    if j == 0:
        return tokens
    b = tokens[j - 1] - BYTE_OFFSET
    if 0 <= b < 256 and int(_UTF8[0, b]) > k - j:
        return tokens[: j - 1]
    return tokens
