"""QA datasets: loading Search-R1 style and rubric rows, and generating the toy, multihop and long-form datasets."""

from rlsearch.data.dataset import DatasetError, QAExample, Rubric, load_qa_dataset
from rlsearch.data.longform import make_longform_data
from rlsearch.data.multihop import make_multihop_data
from rlsearch.data.toy import ToyDataPaths, make_toy_data

__all__ = [
    "DatasetError", "QAExample", "Rubric", "ToyDataPaths", "load_qa_dataset", "make_longform_data",
    "make_multihop_data", "make_toy_data",
]
