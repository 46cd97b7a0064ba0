"""vLLM worker extension: stream weight buckets into the engine inside one layerwise-reload session.

A vLLM layer is (re)processed once all of its elements have arrived (CPU repacks GEMM weights after load).
Each call of vLLM's own `reload_weights` is a complete session, so a layer split across two calls would be
processed with missing elements. Here one session spans all buckets: begin, load each bucket, finish.
Methods are called with `collective_rpc`, which for the AsyncLLM engine crosses into the EngineCore process as
msgpack: a bucket travels as a shared-memory file (`stage_bucket`, one copy) and is mapped there zero-copy; its
checksum is verified in the engine worker, on the bytes the engine loads.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from ..bridge.bucket import TensorEntry, WeightBucket, unpack_bucket

_SHM_DIR = "/dev/shm"


def stage_bucket(bucket: WeightBucket) -> dict:
    """Write the bucket's bytes to a file in shared memory; returns its msgpack-able description (the caller
    deletes ``path`` once the engine has loaded it)."""
    descriptor, path = tempfile.mkstemp(prefix="rlsearch-bucket-", dir=_SHM_DIR if os.path.isdir(_SHM_DIR) else None)
    with os.fdopen(descriptor, "wb") as staging:
        for array in bucket.arrays:
            staging.write(array.data)
    return {
        "path": path,
        "entries": [[entry.name, entry.dtype, list(entry.shape)] for entry in bucket.entries],
        "sizes": [int(array.nbytes) for array in bucket.arrays],
        "checksum": list(bucket.checksum),
    }


def read_staged_bucket(staged: dict) -> WeightBucket:
    """The bucket `stage_bucket` wrote, as read-only views of the mapped file."""
    total = sum(staged["sizes"])
    data = np.memmap(staged["path"], dtype=np.uint8, mode="r") if total else np.empty(0, dtype=np.uint8)
    offsets = np.cumsum([0, *staged["sizes"]])
    arrays = [data[start:end] for start, end in zip(offsets[:-1], offsets[1:])]
    entries = [TensorEntry(name, dtype, tuple(shape)) for name, dtype, shape in staged["entries"]]
    return WeightBucket(entries, arrays, tuple(staged["checksum"]))


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); `self.model_runner` is the worker's."""

    def rlsearch_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())
        self._rlsearch_loaded: set[str] = set()

    def rlsearch_load_weight_bucket(self, staged: dict) -> tuple[int, int]:
        """Load one staged bucket (see `stage_bucket`); returns (tensors, bytes) received."""
        bucket = read_staged_bucket(staged)
        named_tensors = unpack_bucket(bucket)
        loaded = self.model_runner.get_model().load_weights(iter(named_tensors))
        self._rlsearch_loaded.update(loaded or ())
        return len(named_tensors), bucket.nbytes

    def rlsearch_finish_weight_update(self) -> list[str]:
        """Finalise the session; returns the names of model parameters that received no weights."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
        _reprocess_shared_parameter_layers(model)
        return sorted({name for name, _ in model.named_parameters()} - self._rlsearch_loaded)


def _reprocess_shared_parameter_layers(model) -> None:
    """Redo the post-load processing of layers that share a parameter with another layer.

    A tied output layer (lm_head holding embed_tokens' weight) receives no weights of its own, so the reload does
    not process it again, and what its processing derived from the old weight stays: on CPU a prepacked copy of the
    weight for the logits GEMM, which left the engine sampling from the old output layer after every sync. The
    processing of an unquantized layer is idempotent, so running it again on the embedding too is harmless."""
    layers_by_parameter: dict[int, list] = {}
    for layer in model.modules():
        for parameter in layer.parameters(recurse=False):
            layers_by_parameter.setdefault(id(parameter), []).append(layer)
    for layers in layers_by_parameter.values():
        if len(layers) > 1:
            for layer in layers:
                method = getattr(layer, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(layer)
