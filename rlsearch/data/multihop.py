"""A multi-hop QA task over its own generated corpus: each question is a chain of k lookups (k from 2 to 16).

A question names one entity and asks for a chain of relations from it, e.g. "Who is the mentor of the rival of
Brakon?". Brakon's passage names its rival ("The rival of Brakon is Tesmir."), Tesmir's passage names its mentor, and
so on: every passage of a chain names its own title and the next entity of the chain, nothing else, and the answer
is the name in the passage of the chain's last entity. The answer is written in that passage only, and no passage
names an earlier entity of its chain, so an agent that searches for the name it read last needs exactly k searches,
and one that stops a hop early answers with an entity instead. Distractor passages mention a chain entity without
its fact, and ``passage_words`` pads every passage with filler sentences (made of template words, never of names),
so that a trajectory of k searches grows to 8k-32k tokens while the fact stays one sentence within the padding.

All names are unique words (the toy task's name makers); ``learnable`` draws them from the words the Qwen2
tokenizer encodes as one token, so every search and the answer copy one token.
"""

from __future__ import annotations

import functools
import os
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .toy import NameMaker, Passage, ToyDataPaths, learnable_names, passage_row, template_words, write_jsonl

DATA_SOURCE = "multihop"
MIN_HOPS, MAX_HOPS = 2, 16
_RELATIONS = ("mentor", "rival", "teacher", "neighbour", "partner", "cousin", "patron", "apprentice")
_OCCUPATIONS = ("weaver", "potter", "miller", "carpenter", "scribe", "shepherd", "brewer", "glassblower")
_ENCOUNTERS = ("once met", "wrote letters to", "travelled with", "argued with", "traded cloth with")
# filler sentences: a subject, a verb and a place, all template words
_FILLER_SUBJECTS = ("The old road", "A cold wind", "The evening market", "The village bell", "A line of carts",
                    "The autumn fog", "Smoke from the kilns", "The grain store", "A flock of geese", "The night watch")
_FILLER_VERBS = ("stretched along", "drifted over", "was quiet near", "was busy beside", "rang out across",
                 "gathered by", "passed slowly through", "was seen above", "lingered around", "returned to")
_FILLER_PLACES = ("the eastern hills", "the stone bridge", "the long valley", "the harbour wall", "the upper fields",
                  "the town square", "the old orchards", "the salt marsh", "the chapel yard", "the cedar grove")


@dataclass(frozen=True)
class _Chain:
    question: str
    entities: tuple[str, ...]  # E0 .. E(k-1): the titles of the chain's passages, in the order they are searched
    answer: str
    passages: tuple[Passage, ...]  # one per entity, in chain order


@functools.cache
def reserved_words() -> frozenset[str]:
    """Lowercase words no name may be: the template words of this task and of the toy task, and the retriever's
    stopwords (a name that is a stopword could not be searched for)."""
    from bm25s.stopwords import STOPWORDS_EN  # the local retriever's stopwords (rlsearch.tools.servers.retrieval)

    return template_words() | template_words(Path(__file__)) | frozenset(STOPWORDS_EN)


def make_multihop_data(
    out_dir: str | os.PathLike,
    seed: int = 0,
    hops: Iterable[int] = (2, 3, 4),
    num_chains: int = 300,
    test_fraction: float = 0.2,
    distractors_per_entity: int = 1,
    passage_words: int = 0,
    learnable: bool = False,
) -> ToyDataPaths:
    """Write corpus.jsonl, train.jsonl, test.jsonl and README.txt to ``out_dir``; same seed, same bytes.

    ``num_chains`` questions, one per chain, spread evenly over the hop counts ``hops`` (each from 2 to 16), and
    ``test_fraction`` of each hop count's questions go to test.jsonl. Every chain entity gets
    ``distractors_per_entity`` passages that mention it without its fact; every passage gets at least
    ``passage_words`` words of filler. ``learnable``: every name is one word that the Qwen2 tokenizer encodes as a
    single token (each chain takes 1 + k * (1 + distractors_per_entity) of the ~8,900 such words).
    Rows: ``{"id", "question", "golden_answers", "data_source": "multihop", "metadata": {"hops": k, "chain": [the k
    entity titles, E0 first], "passage_ids": [their passages' ids]}}``.
    """
    hop_counts = _check_arguments(hops, num_chains, test_fraction, distractors_per_entity, passage_words)
    rng = random.Random(seed)
    vocabulary = [name for name in learnable_names() if name.lower() not in reserved_words()] if learnable else []
    per_chain = [1 + hop_counts[index % len(hop_counts)] * (1 + distractors_per_entity) for index in range(num_chains)]
    if learnable and sum(per_chain) > len(vocabulary):
        raise ValueError(
            f"{num_chains} chains of {', '.join(map(str, hop_counts))} hops with {distractors_per_entity} "
            f"distractor(s) per entity take {sum(per_chain):,} names, more than the {len(vocabulary):,} single-token "
            "names: lower num_chains, the hops or distractors_per_entity"
        )
    names = NameMaker(rng, reserved_words(), vocabulary)
    chains: list[_Chain] = []
    passages: list[Passage] = []
    for index in range(num_chains):
        chain = _chain(names, rng, hop_counts[index % len(hop_counts)], passage_words)
        chains.append(chain)
        passages.extend(chain.passages)
        for entity in chain.entities:
            passages.extend(_distractor(names, rng, entity, passage_words) for _ in range(distractors_per_entity))
    rng.shuffle(passages)
    passage_ids = {passage.title: str(index) for index, passage in enumerate(passages)}
    rows = [
        {
            "id": f"{DATA_SOURCE}-{index}",
            "question": chain.question,
            "golden_answers": [chain.answer],
            "data_source": DATA_SOURCE,
            "metadata": {"hops": len(chain.entities), "chain": list(chain.entities),
                         "passage_ids": [passage_ids[entity] for entity in chain.entities]},
        }
        for index, chain in enumerate(chains)
    ]
    rng.shuffle(rows)
    train, test = [], []
    for hop_count in hop_counts:  # each hop count is split on its own, so test.jsonl holds every hop count
        same = [row for row in rows if row["metadata"]["hops"] == hop_count]
        num_test = min(len(same) - 1, max(1, round(len(same) * test_fraction)))
        test += same[:num_test]
        train += same[num_test:]
    rng.shuffle(train)
    rng.shuffle(test)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = ToyDataPaths(corpus=out / "corpus.jsonl", train=out / "train.jsonl", test=out / "test.jsonl")
    write_jsonl(paths.corpus, [passage_row(passage_ids[passage.title], passage) for passage in passages])
    write_jsonl(paths.train, train)
    write_jsonl(paths.test, test)
    readme = _readme(seed, hop_counts, len(passages), len(train), len(test), distractors_per_entity, passage_words)
    (out / "README.txt").write_text(readme, encoding="utf-8")
    return paths


def chain_fact(text: str, entity: str) -> str | None:
    """The sentence of ``text`` (a passage or an observation) that names what follows ``entity`` in its chain, e.g.
    "The rival of Brakon is Tesmir."; None when the text has none (the search missed the entity's passage)."""
    found = re.search(rf"The [a-z]+ of {re.escape(entity)} is [^.]+\.", text)
    return found.group(0) if found else None


def parse_hops(text: str) -> tuple[int, ...]:
    """Hop counts written as "2,3,4" (the CLI's --hops); ValueError naming the bad part."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"hops must be whole numbers separated by commas, e.g. 2,3,4; got {text!r}") from None


def _check_arguments(
    hops: Iterable[int], num_chains: int, test_fraction: float, distractors_per_entity: int, passage_words: int
) -> tuple[int, ...]:
    """The distinct hop counts, sorted; ValueError naming the bad argument."""
    hop_counts = tuple(sorted(set(hops)))
    if not hop_counts or any(not MIN_HOPS <= count <= MAX_HOPS for count in hop_counts):
        raise ValueError(f"hops must be one or more counts from {MIN_HOPS} to {MAX_HOPS}, got {list(hop_counts)}")
    if num_chains < 2 * len(hop_counts):
        raise ValueError(
            f"num_chains must be at least {2 * len(hop_counts)} (a train and a test question per hop count), got "
            f"{num_chains}"
        )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be strictly between 0 and 1, got {test_fraction}")
    if distractors_per_entity < 0:
        raise ValueError(f"distractors_per_entity must be >= 0, got {distractors_per_entity}")
    if passage_words < 0:
        raise ValueError(f"passage_words must be >= 0, got {passage_words}")
    return hop_counts


def _chain(names: NameMaker, rng: random.Random, hops: int, passage_words: int) -> _Chain:
    entities = tuple(names.word() for _ in range(hops))
    answer = names.word()
    relations = [rng.choice(_RELATIONS) for _ in range(hops)]
    passages = tuple(
        _passage(rng, entity, f"The {relation} of {entity} is {following}.", passage_words)
        for entity, relation, following in zip(entities, relations, (*entities[1:], answer))
    )
    asked = entities[0]
    for relation in relations:
        asked = f"the {relation} of {asked}"
    return _Chain(f"Who is {asked}?", entities, answer, passages)


def _distractor(names: NameMaker, rng: random.Random, entity: str, passage_words: int) -> Passage:
    title = names.word()
    return _passage(rng, title, f"{title} {rng.choice(_ENCOUNTERS)} {entity}.", passage_words)


def _passage(rng: random.Random, title: str, fact: str, passage_words: int) -> Passage:
    """The title's passage: what it is, then the fact at a random place among the filler sentences."""
    sentences = _filler(rng, passage_words)
    sentences.insert(rng.randint(0, len(sentences)), fact)
    return Passage(title, " ".join([f"{title} is a {rng.choice(_OCCUPATIONS)}.", *sentences]))


def _filler(rng: random.Random, words: int) -> list[str]:
    sentences: list[str] = []
    count = 0
    while count < words:
        sentence = f"{rng.choice(_FILLER_SUBJECTS)} {rng.choice(_FILLER_VERBS)} {rng.choice(_FILLER_PLACES)}."
        sentences.append(sentence)
        count += len(sentence.split())
    return sentences


def _readme(
    seed: int, hop_counts: tuple[int, ...], num_passages: int, num_train: int, num_test: int, distractors: int,
    passage_words: int,
) -> str:
    padding = f" Each passage carries at least {passage_words} words of filler sentences." if passage_words else ""
    return (
        f"Multi-hop QA data made by rlsearch.data.make_multihop_data (seed {seed}). corpus.jsonl holds {num_passages} "
        'passages in the Search-R1 corpus format {"id", "contents"}, where contents is the quoted title, a newline '
        f"and the text. train.jsonl ({num_train} rows) and test.jsonl ({num_test} rows) hold one question per chain "
        f"of k hops (k in {', '.join(map(str, hop_counts))}) as "
        '{"id", "question", "golden_answers", "data_source": "multihop", "metadata": {"hops", "chain", '
        '"passage_ids"}}. The question names the chain\'s first entity; the passage of each chain entity names the '
        "next one and nothing else, and the answer is the name in the passage of the last entity (metadata.chain "
        "lists the k titles in order, metadata.passage_ids their passages), so answering takes exactly k searches, "
        f"each for the name read last. {distractors} distractor passage(s) per chain entity mention it without its "
        f"fact.{padding}\n"
    )
