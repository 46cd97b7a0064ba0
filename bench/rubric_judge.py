"""How well a judge model tells long-form answers apart on the rubrics of `make-toy-data --task longform`: answers of
known quality (every fact with its citation, the look-alike passages' facts instead, one fact of two, none) each
judged on each rubric of its question, under a rubric prompt (rlsearch's shipped 0-2 one, or a yes/no one for small
models), the replies read by rlsearch's verdict parser and summed by DR Tulu's rule, against what a perfect judge
would give.

See docs/benchmarks.md#rubric_judge."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import SMOKE_VOCAB_RANKS, build_model, parse_args  # noqa: E402
from bench.common.table import print_table  # noqa: E402

SMOLLM2_DIR = Path("outputs/assets/smollm2-135m-instruct")
# the long-form rubrics as rlsearch.data.longform writes them: a fact with its citation, and a look-alike's fact
FACT = re.compile(r'^Answers "(?P<question>.*)" with (?P<answer>.*) and cites the passage that says so, '
                  r'<cite id="(?P<passage>[^"]+)">\.$')
PITFALL = re.compile(r'^Answers "(?P<question>.*)" with (?P<answer>.*), a fact of .*$')
KINDS = ("good", "half", "empty", "pitfall")


def answers_of_known_quality(example) -> dict[str, tuple[str, list[float]]]:
    """Per kind, the answer and what a perfect judge scores it on each rubric (1 met, 0 not)."""
    facts = [FACT.match(rubric.text) for rubric in example.rubrics if rubric.weight > 0]
    pitfalls = [PITFALL.match(rubric.text) for rubric in example.rubrics if rubric.weight < 0]
    if not all(facts) or not all(pitfalls):
        raise ValueError(f"{example.id}: a rubric not in rlsearch.data.longform's form")

    def cited(fact) -> str:
        return f'{fact["question"]} {fact["answer"]} <cite id="{fact["passage"]}">.'

    texts = {"good": " ".join(cited(fact) for fact in facts), "half": cited(facts[0]),
             "empty": "I could not find these facts.",
             "pitfall": " ".join(f'{pitfall["question"]} {pitfall["answer"]}.' for pitfall in pitfalls)}
    first_fact = next(rubric for rubric in example.rubrics if rubric.weight > 0)
    met = {"good": lambda rubric: rubric.weight > 0, "half": lambda rubric: rubric is first_fact,
           "empty": lambda rubric: False, "pitfall": lambda rubric: rubric.weight < 0}
    return {kind: (f"<answer> {texts[kind]} </answer>", [float(met[kind](rubric)) for rubric in example.rubrics])
            for kind in KINDS}


def _judge(model_dir: Path, threads: int):
    """Greedy replies of the judge model to chat prompts (HF transformers, fp32: the argmax a frozen engine takes)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def reply(prompt: str, max_tokens: int) -> str:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return reply


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--judge", default=str(SMOLLM2_DIR),
                        help="the judge's HF model dir (default SmolLM2-135M-Instruct: rlsearch make-real-model)")
    parser.add_argument("--prompt", default="yes-no", help="yes-no (rlsearch/reward/prompts/rubric_yes_no.txt), "
                        "shipped (rubric.txt there, the default rubric prompt), or a template file with {question}, "
                        "{response} and {rubric}")
    parser.add_argument("--max-tokens", type=int, default=0, help="of each reply; 0: 1 for yes-no, 8 otherwise")
    parser.add_argument("--questions", type=int, default=60, help="long-form questions made (20%% held out: judged)")
    parser.add_argument("--facts", type=int, default=2, help="facts per question")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="outputs/bench/rubric_judge", help="where the data (and a random judge) go")
    return parser


def main() -> None:
    args = parse_args(_parser(), dict(judge="", questions=5, facts=2))
    from rlsearch.data import load_qa_dataset
    from rlsearch.data.longform import make_longform_data
    from rlsearch.reward.judge import PROMPTS_DIR
    from rlsearch.reward.rubric import dr_tulu_rubric_score
    from rlsearch.reward.verdict import parse_verdict

    out = Path(args.out)
    judge_dir = Path(args.judge) if args.judge else build_model("tiny", out, vocab_ranks=SMOKE_VOCAB_RANKS)
    shipped = {"yes-no": PROMPTS_DIR / "rubric_yes_no.txt", "shipped": PROMPTS_DIR / "rubric.txt"}
    template = shipped.get(args.prompt, Path(args.prompt)).read_text()
    max_tokens = args.max_tokens or (1 if args.prompt == "yes-no" else 8)
    data = make_longform_data(out / "longform", seed=0, num_questions=args.questions, facts_per_question=args.facts)
    examples = load_qa_dataset(data.test)
    reply = _judge(judge_dir, args.threads)
    started = time.perf_counter()
    scores: dict[str, list[tuple[float, float | None]]] = {kind: [] for kind in KINDS}  # (perfect, judged)
    said_yes: dict[tuple[str, bool], list[float]] = {}  # (positive or pitfall rubric, met): the judge's verdicts
    no_verdict = judged = 0
    for example in examples:
        for kind, (answer, perfect) in answers_of_known_quality(example).items():
            verdicts = []
            for rubric, met in zip(example.rubrics, perfect):
                prompt = (template.replace("{question}", example.question).replace("{response}", answer)
                          .replace("{rubric}", rubric.text))
                verdict = parse_verdict(reply(prompt, max_tokens), 2)
                verdicts.append(verdict)
                judged += 1
                no_verdict += verdict is None
                if verdict is not None:
                    said_yes.setdefault(("fact" if rubric.weight > 0 else "pitfall", bool(met)), []).append(verdict)
            score = None if None in verdicts else dr_tulu_rubric_score(example.rubrics, verdicts)
            scores[kind].append((dr_tulu_rubric_score(example.rubrics, perfect), score))
    print(f"judge {judge_dir} ({args.prompt} prompt, {max_tokens} token(s) a reply): {len(examples)} questions, "
          f"{judged} judgements in {time.perf_counter() - started:.0f} s, {no_verdict} without a verdict", flush=True)

    def mean(values) -> str:
        values = [value for value in values if value is not None]
        return f"{statistics.fmean(values):+.3f}" if values else "nan"

    print_table([("answer", "<8"), ("rubric score, perfect judge", ">27"), ("this judge", ">10"),
                 ("answers with every verdict", ">26")],
                [[kind, mean(p for p, _ in pairs), mean(j for _, j in pairs),
                  f"{sum(j is not None for _, j in pairs)} of {len(pairs)}"] for kind, pairs in scores.items()])
    print_table([("rubric", "<8"), ("met by the answer", ">17"), ("mean verdict", ">16")],
                [[rubric, "yes" if met else "no", f"{statistics.fmean(values):.2f} of {len(values)}"]
                 for (rubric, met), values in sorted(said_yes.items())])


if __name__ == "__main__":
    main()
