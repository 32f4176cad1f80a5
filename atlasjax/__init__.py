"""atlasjax: a JAX/XLA LLM inference engine for NVIDIA Hopper GPUs.

    from atlasjax import LLM, SamplingParams
    llm = LLM()                       # the embedded SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0))
    print(out[0].outputs[0].text)
"""
from atlasjax.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from atlasjax.lora import LoRARequest
from atlasjax.errors import (AtlasJaxError, CheckpointError, EngineConfigError, InvalidRequestError,
                             UnsupportedModelError)
from atlasjax.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, Logprob, PoolingRequestOutput, RequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from atlasjax.pooling import PoolingParams
from atlasjax.sampling_params import SamplingParams


def __getattr__(name):
    # The engine pulls in jax and flax: import it only when asked for.
    if name == "LLM":
        from atlasjax.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from atlasjax.async_llm import AsyncLLM
        return AsyncLLM
    if name == "EngineConfig":
        from atlasjax.engine_config import EngineConfig
        return EngineConfig
    raise AttributeError(name)


__all__ = ["LLM", "AsyncLLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "PoolingParams", "LoRARequest",
           "EmbeddingOutput",
           "EmbeddingRequestOutput", "ScoringOutput", "ScoringRequestOutput", "ClassificationOutput",
           "ClassificationRequestOutput", "PoolingRequestOutput",
           "AtlasJaxError", "CheckpointError", "EngineConfigError", "InvalidRequestError", "UnsupportedModelError"]
__version__ = "0.1.0"
