"""A tolerant parser of LLM-judge replies: a score in [0, 1], or None when the reply holds no verdict.

Accepted, case-insensitive, after dropping ``<think>...</think>`` reasoning (first match wins):

1. a JSON object anywhere in the reply with a key ``correct``, ``verdict``, ``score`` or ``grade`` (checked in that
   order): true/false, a number, or a phrase as in 3;
2. the last line labelled ``verdict``, ``judgement``/``judgment``, ``grade``, ``score``, ``rating``, ``decision``
   or ``result`` followed by ``:`` or ``=``: its value as in 3;
3. the whole reply as a phrase. Markdown emphasis, quotes and trailing ``.``/``!`` are ignored.

Phrases: correct / right / yes / true / pass -> 1; incorrect / not correct / wrong / no / false / fail -> 0;
partial / partially / partially correct -> 0.5; ``x/d`` or ``x out of d`` -> x/d (0 <= x <= d); a bare number x
-> x/scale when a scale is given (the rubric scorer asks for 0, 1 or 2: scale 2), else x when 0 <= x <= 1 and x/10
when 1 < x <= 10. Anything else (an empty reply, a number out of range, prose) is no verdict.
"""

from __future__ import annotations

import json
import re

_THINKING = re.compile(r"<think>.*?</think>|^.*?</think>", re.DOTALL | re.IGNORECASE)
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
_JSON_KEYS = ("correct", "verdict", "score", "grade")
_LABELLED = re.compile(
    r"^[\W_]*(?:verdict|judgement|judgment|grade|score|rating|decision|result)[*_\s]*[:=]\s*(.+)$",
    re.IGNORECASE | re.MULTILINE,
)
_FRACTION = re.compile(r"(\d+(?:\.\d+)?)\s*(?:/|out of)\s*(\d+(?:\.\d+)?)")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_WORDS = {
    "correct": 1.0, "right": 1.0, "yes": 1.0, "true": 1.0, "pass": 1.0,
    "incorrect": 0.0, "not correct": 0.0, "wrong": 0.0, "no": 0.0, "false": 0.0, "fail": 0.0,
    "partial": 0.5, "partially": 0.5, "partially correct": 0.5,
}


def parse_verdict(reply: str, scale: float | None = None) -> float | None:
    """The judge's score in [0, 1] (see the module doc for what is accepted), or None."""
    text = without_thinking(reply).strip()
    for candidate in _JSON_OBJECT.findall(text):
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        for key in _JSON_KEYS:
            if isinstance(obj, dict) and key in obj:
                return _value(obj[key], scale)
    labelled = _LABELLED.findall(text)
    return _phrase(labelled[-1] if labelled else text, scale)


def without_thinking(reply: str) -> str:
    """``reply`` less its ``<think>...</think>`` reasoning (or all before a lone ``</think>``)."""
    return _THINKING.sub("", reply)


def _value(value: object, scale: float | None) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return _number(float(value), scale)
    return _phrase(value, scale) if isinstance(value, str) else None


def _phrase(text: str, scale: float | None) -> float | None:
    cleaned = text.strip().strip("*_`\"' ").rstrip(".!").strip("*_`\"' ").lower()
    if cleaned in _WORDS:
        return _WORDS[cleaned]
    fraction = _FRACTION.fullmatch(cleaned)
    if fraction:
        numerator, denominator = float(fraction[1]), float(fraction[2])
        return numerator / denominator if 0 <= numerator <= denominator and denominator > 0 else None
    return _number(float(cleaned), scale) if _NUMBER.fullmatch(cleaned) else None


def _number(value: float, scale: float | None) -> float | None:
    if scale is not None:
        return value / scale if 0 <= value <= scale else None
    if 0 <= value <= 1:
        return value
    return value / 10 if 1 < value <= 10 else None
