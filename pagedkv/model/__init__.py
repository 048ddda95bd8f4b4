"""A real language model on the paged cache: SmolLM2-135M-Instruct (Llama architecture).

* :mod:`~pagedkv.model.gguf` reads the GGUF file (hyperparameters, weights, vocabulary);
* :mod:`~pagedkv.model.tokenizer` turns text into token ids and back, with the chat template;
* :mod:`~pagedkv.model.llama` is the forward pass with K/V only in pagedkv's pool;
* :mod:`~pagedkv.model.reference` is the same model on a plain contiguous cache (the oracle);
* :mod:`~pagedkv.model.engine` runs requests with continuous batching: greedy, sampling,
  parallel sampling and beam search (the requests' types in :mod:`~pagedkv.model.requests`,
  choosing tokens in :mod:`~pagedkv.model.sampling`), its memory through
  :mod:`~pagedkv.model.scheduling` and its passes through :mod:`~pagedkv.model.runner`.
"""
from .gguf import LlamaConfig, ModelNotFound, load_gguf, model_path
from .llama import Batch, Llama, PagedKV, forward, random_weights
from .tokenizer import Tokenizer, chat_prompt

__all__ = ["LlamaConfig", "ModelNotFound", "load_gguf", "model_path", "Batch", "Llama",
           "PagedKV", "forward", "random_weights", "Tokenizer", "chat_prompt"]
