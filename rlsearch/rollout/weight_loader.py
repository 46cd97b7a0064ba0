"""vLLM worker extension: stream weight buckets into the engine inside one layerwise-reload session.

A vLLM layer is (re)processed once all of its elements have arrived (CPU repacks GEMM weights after load).
Each call of vLLM's own `reload_weights` is a complete session, so a layer split across two calls would be
processed with missing elements. Here one session spans all buckets: begin, load each bucket, finish.
Methods are called with `LLM.collective_rpc`, so the same code serves in-process and multi-process engines.
"""

from __future__ import annotations

from ..bridge.bucket import WeightBucket, unpack_bucket


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); `self.model_runner` is the worker's."""

    def rlsearch_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())
        self._rlsearch_loaded: set[str] = set()

    def rlsearch_load_weight_bucket(self, bucket: WeightBucket) -> tuple[int, int]:
        """Load one bucket; returns (tensors, bytes) received."""
        named_tensors = unpack_bucket(bucket)
        loaded = self.model_runner.get_model().load_weights(iter(named_tensors))
        self._rlsearch_loaded.update(loaded or ())
        return len(named_tensors), bucket.nbytes

    def rlsearch_finish_weight_update(self) -> list[str]:
        """Finalise the session; returns the names of model parameters that received no weights."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
        return sorted({name for name, _ in model.named_parameters()} - self._rlsearch_loaded)
