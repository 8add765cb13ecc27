"""Scores of one answer against its label, and their means over a set.

exact: the answer equals the expected one, whitespace at the ends aside. cer: edit distance /
the expected answer's characters (text items). iou: boxes matched one to one, best pairs first;
the sum of the matched pairs' IoU over the larger of the two counts (a missing or an extra box
costs a whole box). point_hits: the same with points, a pair matching when they are within
POINT_RADIUS (0-1000 units) of each other."""

from __future__ import annotations

import math
from statistics import fmean

from qvl.grounding import Box, Point, parse

POINT_RADIUS = 50  # 5% of the picture's side


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one character)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def cer(answer: str, expected: str) -> float:
    answer, expected = answer.strip(), expected.strip()
    return edit_distance(answer, expected) / max(1, len(expected))


def iou(a: Box, b: Box) -> float:
    w = max(0.0, min(a.x2, b.x2) - max(a.x1, b.x1))
    h = max(0.0, min(a.y2, b.y2) - max(a.y1, b.y1))
    union = (a.x2 - a.x1) * (a.y2 - a.y1) + (b.x2 - b.x1) * (b.y2 - b.y1) - w * h
    return w * h / union if union > 0 else 0.0


def matched(found: list, expected: list, similarity) -> float:
    """Greedy one-to-one matching, most similar pairs first (pairs of similarity 0 never match):
    the matched similarities' sum over max(len(found), len(expected)); 1.0 when both are empty."""
    if not found and not expected:
        return 1.0
    pairs = sorted(((similarity(f, e), i, j) for i, f in enumerate(found) for j, e in enumerate(expected)),
                   reverse=True)
    used_f, used_e, total = set(), set(), 0.0
    for value, i, j in pairs:
        if value > 0 and i not in used_f and j not in used_e:
            used_f.add(i)
            used_e.add(j)
            total += value
    return total / max(len(found), len(expected))


def point_hit(a: Point, b: Point) -> float:
    return float(math.dist((a.x, a.y), (b.x, b.y)) <= POINT_RADIUS)


def score(answer: str | None, expected: str, kind: str) -> dict:
    """The scores of one answer (None: the item failed, every score its worst)."""
    if answer is None:
        return {"exact": False, **({"cer": 1.0} if kind == "text" else {"iou": 0.0} if kind == "boxes"
                                   else {"point_hits": 0.0})}
    out: dict = {"exact": answer.strip() == expected.strip()}
    if kind == "text":
        out["cer"] = cer(answer, expected)
    else:
        (boxes, points), (want_boxes, want_points) = parse(answer), parse(expected)
        if kind == "boxes":
            out["iou"] = matched(boxes, want_boxes, iou)
        else:
            out["point_hits"] = matched(points, want_points, point_hit)
    return out


def summary(scored: list[dict]) -> dict:
    """Means over a configuration's items: exact match overall and per kind, CER, IoU, point hits."""
    out = {"items": len(scored), "failed": sum("error" in s for s in scored),
           "exact": fmean(s["exact"] for s in scored)}
    for kind, metric in (("text", "cer"), ("boxes", "iou"), ("points", "point_hits")):
        of_kind = [s for s in scored if s["kind"] == kind]
        if of_kind:
            out[kind] = {"items": len(of_kind), "exact": fmean(s["exact"] for s in of_kind),
                         metric: fmean(s[metric] for s in of_kind)}
    return out
