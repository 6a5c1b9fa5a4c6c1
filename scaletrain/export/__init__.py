"""Export to formats other tools read, from a checkpoint (``scaletrain export --format hf|ct2``).

* :mod:`~scaletrain.export.hf`: the byte Transformer as a Hugging Face ``MarianMTModel`` directory
  (weights under Marian's names, the position table, a byte-level tokenizer, generation settings, a
  model card) that ``transformers`` loads with no scaletrain code;
* :mod:`~scaletrain.export.ct2`: that directory converted with CTranslate2's own converter, and
  translating with the converted model as scaletrain decodes;
* :mod:`~scaletrain.export.single_file`: scaletrain's own single file (``--format safetensors``), the
  consolidated weights with the config in their metadata, which ``scaletrain.checkpoint.load_exported``
  reads back for ``evaluate`` and ``translate``.

Layer: above ``checkpoint/`` (reads checkpoints through it), ``models/``, ``vocab/``, ``config``;
imported only by ``commands/``. ``transformers``, ``tokenizers`` and ``ctranslate2`` are imported inside
the functions that use them: importing this package loads none of them.
"""
from scaletrain.export.ct2 import convert_hf_dir, export_ct2, translate_ct2
from scaletrain.export.hf import MAPPING_RECIPES, byte_tokenizer, export_hf, marian_problems
from scaletrain.export.single_file import DTYPES, export_checkpoint

__all__ = ["DTYPES", "MAPPING_RECIPES", "byte_tokenizer", "convert_hf_dir", "export_checkpoint", "export_ct2",
           "export_hf", "marian_problems", "translate_ct2"]
