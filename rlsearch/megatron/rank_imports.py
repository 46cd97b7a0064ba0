"""What every Megatron rank process imports, imported once by the server that forks CPU ranks (processes.py) and
shared by every rank it forks. Megatron's and mbridge's warnings about missing Apex and Transformer Engine, printed
on every import, are silenced here; the filters are not passed on to the ranks."""

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", module=r"(megatron|mbridge)\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import mbridge  # noqa: F401
    import megatron.core  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401

    from . import model, parallel, training  # noqa: F401
