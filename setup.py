from pathlib import Path

from setuptools import find_packages, setup


def requirements(name: str) -> list[str]:
    lines = (Path(__file__).parent / "requirements" / f"{name}.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


setup(
    name="rlsearch",
    version="0.1.0",
    description="Train LLM search agents with RL: Megatron-core actor, vLLM rollout, Ray orchestration",
    packages=find_packages(include=["rlsearch", "rlsearch.*"]),
    package_data={"rlsearch": ["data/templates/*.txt", "tools/protocols/prompts/*.yaml", "reward/prompts/*.txt",
                                  "tools/clients/prompts/*.txt"]},
    python_requires=">=3.10",
    install_requires=[],
    extras_require={"cpu": requirements("cpu"), "gpu": requirements("gpu"), "test": requirements("test")},
    entry_points={"console_scripts": ["rlsearch=rlsearch.cli:main"]},
)
