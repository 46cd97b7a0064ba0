"""QA datasets: loading Search-R1 style files and generating the embedded toy and multihop datasets."""

from rlsearch.data.dataset import DatasetError, QAExample, Rubric, load_qa_dataset
from rlsearch.data.multihop import make_multihop_data
from rlsearch.data.toy import ToyDataPaths, make_toy_data

__all__ = [
    "DatasetError", "QAExample", "Rubric", "ToyDataPaths", "load_qa_dataset", "make_multihop_data", "make_toy_data",
]
