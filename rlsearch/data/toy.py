"""A small synthetic QA dataset with its own retrieval corpus, generated deterministically from a seed.

Every fact is about an invented entity with a made-up name, so a model cannot answer from memory: the
answer is written in exactly one corpus passage and has to be retrieved. Each question entity gets
distractor passages of the same kind that mention it without giving its facts, so retrieval must rank
the right passage above look-alikes.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

_ONSETS = ("", "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "br", "dr", "kr", "st", "th")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou")
_CODAS = ("", "", "", "", "n", "r", "l", "s", "m", "th")
_MAX_NAME_LENGTH = 9
_PURPOSES = ("spinning wool", "grinding grain", "measuring tides", "lifting stone", "weaving rope")
_FIRST_YEAR = 1000
_LAST_POSSIBLE_YEAR = 9999  # years stay 4 digits so that no year is a substring of another


@dataclass(frozen=True)
class ToyDataPaths:
    corpus: Path
    train: Path
    test: Path


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    question: str
    golden_answers: tuple[str, ...]


@dataclass(frozen=True)
class Entity:
    passage: Passage
    questions: tuple[Question, ...]  # one per fact of its passage, the same for every entity of its kind


class NameMaker:
    """Invents pronounceable names whose words are unique, so each name occurs in one passage only. With a
    ``vocabulary`` every name is one unused word of it instead (a person too), e.g. words that are one token."""

    def __init__(self, rng: random.Random, reserved_words: AbstractSet[str], vocabulary: Sequence[str] = ()) -> None:
        self._rng = rng
        self._used_words = set(reserved_words)
        self._from_vocabulary = bool(vocabulary)
        self._vocabulary = list(vocabulary)
        self._vocabulary_size = len(self._vocabulary)
        rng.shuffle(self._vocabulary)

    def word(self, min_syllables: int = 2, max_syllables: int = 3) -> str:
        if self._from_vocabulary:
            return self._vocabulary_word()
        while True:
            syllables = self._rng.randint(min_syllables, max_syllables)
            candidate = "".join(self._syllable() for _ in range(syllables)).capitalize()
            if 4 <= len(candidate) <= _MAX_NAME_LENGTH and candidate.lower() not in self._used_words:
                self._used_words.add(candidate.lower())
                return candidate

    def person(self) -> str:
        if self._from_vocabulary:
            return self._vocabulary_word()
        return f"{self.word(2, 3)} {self.word(1, 2)}"

    def _vocabulary_word(self) -> str:
        """The next unused word (the vocabulary holds each word once, reserved words already removed)."""
        if self._vocabulary:
            return self._vocabulary.pop()
        raise ValueError(
            f"the {self._vocabulary_size:,} single-token names ran out (each passage takes 3, 1 with an answer_pool):"
            " lower num_entities or distractors_per_entity so that num_entities * (1 + distractors_per_entity) * "
            f"names per passage stays within {self._vocabulary_size:,}, or raise name_pool"
        )

    def _syllable(self) -> str:
        return self._rng.choice(_ONSETS) + self._rng.choice(_VOWELS) + self._rng.choice(_CODAS)


class _PooledNames:
    """Fact names from a fixed pool: each name once in a shuffle of the pool, and so on with a new shuffle. A name
    recurs in other passages (so an answer may be in other passages too), seldom in the same one."""

    def __init__(self, rng: random.Random, pool: Sequence[str]) -> None:
        self._rng = rng
        self._pool = list(pool)
        self._unused: list[str] = []

    def word(self) -> str:
        if not self._unused:
            self._unused = list(self._pool)
            self._rng.shuffle(self._unused)
        return self._unused.pop()

    person = word


_FactNames = NameMaker | _PooledNames
# Each kind builds an entity from (names of the title, names of facts, rng, year, name of the question entity it
# distracts from or None). The title is drawn first, so that with one NameMaker for all the names stay the same.
_EntityBuilder = Callable[[NameMaker, _FactNames, random.Random, int, str | None], Entity]


def _entity(title: str, text: str, rival: str | None, rival_text: str, questions: tuple[tuple, ...]) -> Entity:
    """The passage about `title` (with `rival_text` in a distractor) and its (question, answers)."""
    if rival:
        text += rival_text
    return Entity(Passage(title, text), tuple(Question(question, answers) for question, answers in questions))


def _town(names: NameMaker, facts: _FactNames, rng: random.Random, year: int, rival: str | None) -> Entity:
    town = names.word()
    river, mayor = facts.word(), facts.person()
    return _entity(
        town, f"{town} is a town on the river {river}. Its mayor is {mayor}. It was founded in {year}.",
        rival, f" It is twinned with {rival}.",
        (
            (f"Who is the mayor of {town}?", (mayor,)),
            (f"On which river does the town of {town} lie?", (river,)),
            (f"In which year was {town} founded?", (str(year),)),
        ),
    )


def _inventor(names: NameMaker, facts: _FactNames, rng: random.Random, year: int, rival: str | None) -> Entity:
    inventor = names.person()
    birthplace, machine = facts.word(), facts.word()
    text = (
        f"{inventor} was an inventor born in the town of {birthplace}. "
        f"In {year} {inventor} built the {machine}, a machine for {rng.choice(_PURPOSES)}."
    )
    return _entity(
        inventor, text, rival, f" {inventor} was a rival of {rival}.",
        (
            (f"In which town was the inventor {inventor} born?", (birthplace,)),
            (f"What machine did the inventor {inventor} build?", (machine,)),
            (f"In which year did {inventor} build the {machine}?", (str(year),)),
        ),
    )


def _river(names: NameMaker, facts: _FactNames, rng: random.Random, year: int, rival: str | None) -> Entity:
    river = names.word()
    mountain, lake = facts.word(), facts.word()
    text = (
        f"The {river} is a river that rises on Mount {mountain} and flows into Lake {lake}. "
        f"Its oldest bridge was built in {year}."
    )
    return _entity(
        river, text, rival, f" It is often confused with the {rival}.",
        (
            (f"Into which lake does the {river} river flow?", (f"Lake {lake}", lake)),
            (f"On which mountain does the {river} river rise?", (f"Mount {mountain}", mountain)),
            (f"In which year was the oldest bridge over the {river} built?", (str(year),)),
        ),
    )


def _invention(names: NameMaker, facts: _FactNames, rng: random.Random, year: int, rival: str | None) -> Entity:
    invention = names.word()
    inventor, workshop_town = facts.person(), facts.word()
    text = (
        f"The {invention} is a device for {rng.choice(_PURPOSES)} invented by {inventor} in {year}. "
        f"It was first made in the workshops of {workshop_town}."
    )
    return _entity(
        invention, text, rival, f" It is often compared with the {rival}.",
        (
            (f"Who invented the {invention}?", (inventor,)),
            (f"In which town was the {invention} first made?", (workshop_town,)),
            (f"In which year was the {invention} invented?", (str(year),)),
        ),
    )


_KINDS: tuple[_EntityBuilder, ...] = (_town, _inventor, _river, _invention)


@functools.cache
def template_words(source: Path = Path(__file__)) -> frozenset[str]:
    # Names must never coincide with a template word ("River", "Lake", ...), or an answer could appear in
    # passages about other entities. This module's own source holds every template word, even after edits (the
    # multihop task passes its own source too).
    template_source = source.read_text(encoding="utf-8")
    return frozenset(word.lower() for word in re.findall(r"[A-Za-z]+", template_source))


def passage_row(passage_id: str, passage: Passage) -> dict[str, str]:
    return {"id": passage_id, "contents": f'"{passage.title}"\n{passage.text}'}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def _check_arguments(num_entities: int, test_fraction: float, distractors_per_entity: int) -> None:
    if num_entities < 2:
        raise ValueError(
            f"num_entities must be at least 2 (one train and one test question), got {num_entities}"
        )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be strictly between 0 and 1, got {test_fraction}")
    if distractors_per_entity < 0:
        raise ValueError(f"distractors_per_entity must be >= 0, got {distractors_per_entity}")
    num_passages = num_entities * (1 + distractors_per_entity)
    if num_passages > _LAST_POSSIBLE_YEAR - _FIRST_YEAR + 1:
        raise ValueError(
            f"{num_passages} passages need more unique 4-digit years than exist; "
            "lower num_entities or distractors_per_entity"
        )


@functools.cache
def single_token_names() -> tuple[str, ...]:
    """Capitalised words of 4-9 letters that the Qwen2 tokenizer encodes as one token after a space (about 9,000)."""
    from .tiny_model import build_qwen2_tokenizer

    space = "\u0120"  # byte-level BPE's mark for a leading space
    vocabulary = build_qwen2_tokenizer().get_vocab()
    return tuple(sorted(token[1:] for token in vocabulary if re.fullmatch(space + r"[A-Z][a-z]{3,8}", token)))


@functools.cache
def _shuffled_learnable_names() -> tuple[str, ...]:
    """The single-token names that are no template word, in one fixed shuffle (the same whatever the data seed)."""
    names = [word for word in single_token_names() if word.lower() not in template_words()]
    random.Random(0).shuffle(names)
    return tuple(names)


def learnable_names(name_pool: int = 0, answer_pool: int = 0) -> list[str]:
    """The names of the learnable variant: single-token words that are no template word. ``name_pool`` > 0 keeps
    the first that many of a fixed shuffle, the same ones whatever the data seed, so that corpora made with
    different seeds share their name tokens and a model trained on many of them sees every name often.
    ``answer_pool`` > 0 keeps out the last that many of the shuffle: the `answer_names`."""
    names = _shuffled_learnable_names()
    if name_pool + answer_pool > len(names):
        raise ValueError(
            f"name_pool + answer_pool must be at most {len(names):,} (the single-token names), got "
            f"{name_pool} + {answer_pool}"
        )
    return sorted(names[: name_pool or len(names) - answer_pool])


def answer_names(answer_pool: int) -> list[str]:
    """The ``answer_pool`` names every fact of the learnable variant is drawn from: the last of `learnable_names`'
    fixed shuffle, so never the name of a title."""
    names = _shuffled_learnable_names()
    return sorted(names[len(names) - answer_pool:])


def generate_entities(
    rng: random.Random, num_entities: int, distractors_per_entity: int, learnable: bool = False, name_pool: int = 0,
    answer_pool: int = 0,
) -> tuple[list[Passage], list[tuple[Entity, Question, list[Entity]]]]:
    """All passages (each entity's, with its distractors' after it), and for each question entity: the entity, the
    question asked about it and its distractors (entities of its kind that mention it, with facts of their own)."""
    names = NameMaker(rng, template_words(), learnable_names(name_pool, answer_pool) if learnable else ())
    facts: _FactNames = _PooledNames(rng, answer_names(answer_pool)) if answer_pool else names
    num_passages = num_entities * (1 + distractors_per_entity)
    # Every passage gets its own year; they stay within 1000-1999 unless there are more passages than that.
    last_year = max(_FIRST_YEAR + 999, _FIRST_YEAR + num_passages - 1)
    years = iter(rng.sample(range(_FIRST_YEAR, last_year + 1), num_passages))
    passages: list[Passage] = []
    asked: list[tuple[Entity, Question, list[Entity]]] = []
    for _ in range(num_entities):
        kind = rng.choice(_KINDS)
        entity = kind(names, facts, rng, next(years), None)
        # the learnable variant asks only for names (one token each), never for a year (four digit tokens)
        questions = [q for q in entity.questions if not (learnable and q.golden_answers[0].isdigit())]
        question = rng.choice(questions)
        distractors = [kind(names, facts, rng, next(years), entity.passage.title)
                       for _ in range(distractors_per_entity)]
        asked.append((entity, question, distractors))
        passages.append(entity.passage)
        passages.extend(distractor.passage for distractor in distractors)
    return passages, asked


def make_toy_data(
    out_dir: str | os.PathLike,
    seed: int = 0,
    num_entities: int = 200,
    test_fraction: float = 0.2,
    distractors_per_entity: int = 2,
    learnable: bool = False,
    name_pool: int = 0,
    answer_pool: int = 0,
) -> ToyDataPaths:
    """Write corpus.jsonl, train.jsonl, test.jsonl and README.txt to ``out_dir``; same seed, same bytes.

    One question is asked about each of ``num_entities`` entities; its answer appears in that entity's
    passage and nowhere else in the corpus. ``learnable``: every name is one real word that the Qwen2 tokenizer
    encodes as a single token and no question asks for a year, so searching means copying one token from the
    question and answering means copying one token from the passage, a simpler task for small models (the facts
    are still invented, so a pretrained model cannot answer from memory either). ``name_pool`` (learnable only):
    draw the names from a fixed set of that many words (see `learnable_names`). ``answer_pool`` (learnable only):
    every name but the passage's title (so every answer) is drawn, with repeats, from another fixed set of that
    many words (`answer_names`), and each title is unique: a passage is still retrieved by its title, but its
    answer may be in other passages too, and there can be more unique entity names than a run memorises.
    """
    for pool_name, pool_size in (("name_pool", name_pool), ("answer_pool", answer_pool)):
        if pool_size and not learnable:
            raise ValueError(f"{pool_name} applies to the learnable variant only (learnable=True)")
    _check_arguments(num_entities, test_fraction, distractors_per_entity)
    rng = random.Random(seed)
    passages, asked = generate_entities(rng, num_entities, distractors_per_entity, learnable, name_pool, answer_pool)
    rng.shuffle(passages)
    passage_ids = {passage.title: str(index) for index, passage in enumerate(passages)}
    qa_rows = [
        {
            "id": f"toy-{entity_index}",
            "question": question.question,
            "golden_answers": list(question.golden_answers),
            "data_source": "toy",
            # the entity asked about: the passage's title, and the query a demonstration searches for
            "metadata": {"passage_id": passage_ids[entity.passage.title], "entity": entity.passage.title},
        }
        for entity_index, (entity, question, _) in enumerate(asked)
    ]
    rng.shuffle(qa_rows)
    num_test = min(num_entities - 1, max(1, round(num_entities * test_fraction)))
    readme = _readme(seed, num_entities, len(passages), num_test, answer_pool)
    return write_toy_data(out_dir, passages, passage_ids, qa_rows, num_test, readme)


def write_toy_data(out_dir: str | os.PathLike, passages: list[Passage], passage_ids: dict[str, str],
                   qa_rows: list[dict], num_test: int, readme: str) -> ToyDataPaths:
    """The corpus, the first num_test rows as test and the remaining ones as train, and the README, in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = ToyDataPaths(corpus=out / "corpus.jsonl", train=out / "train.jsonl", test=out / "test.jsonl")
    write_jsonl(paths.corpus, [passage_row(passage_ids[passage.title], passage) for passage in passages])
    write_jsonl(paths.train, qa_rows[num_test:])
    write_jsonl(paths.test, qa_rows[:num_test])
    (out / "README.txt").write_text(readme, encoding="utf-8")
    return paths


def _readme(seed: int, num_entities: int, num_passages: int, num_test: int, answer_pool: int) -> str:
    where_answers_are = (
        f"Every answer appears in that passage; answers are drawn from a pool of {answer_pool} names, so one may "
        "appear in other passages too, but every passage has its own title (the entity asked about), "
        if answer_pool else "Every answer appears in that passage and in no other, and the remaining passages are "
        "distractors that mention a question entity without stating its facts, "
    )
    return (
        f"Synthetic QA data made by rlsearch.data.make_toy_data (seed {seed}). corpus.jsonl holds {num_passages} "
        'passages in the Search-R1 corpus format {"id", "contents"}, where contents is the quoted title, a '
        "newline and the text; each passage describes an invented town, inventor, river or invention. "
        f"train.jsonl ({num_entities - num_test} rows) and test.jsonl ({num_test} rows) hold one question per "
        'question entity as {"id", "question", "golden_answers", "data_source": "toy", "metadata"}, where '
        f"metadata.passage_id is the id of the passage holding the answer. {where_answers_are}"
        "so the questions can only be answered by retrieving the right passage.\n"
    )
