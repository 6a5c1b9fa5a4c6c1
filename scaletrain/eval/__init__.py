"""Evaluation: decoding, scoring, the ``evaluate`` and ``translate`` library code, in-training validation.

* :mod:`scaletrain.eval.generate` - greedy and beam-search decoding (``generate``, ``generate_with_scores``), built
  of ``decode_step`` (one decoder step, the hypothesis), ``beam`` (beam search), ``utf8_guard`` (the stop at
  invalid UTF-8) and ``bounds`` (output length limits, ``decoding_bounds``);
* :mod:`scaletrain.eval.requests` - ``translate_examples``: requests batched by length, translated in input order;
* :mod:`scaletrain.eval.scoring` - sacrebleu BLEU/chrF per direction and language group, tables, JSON;
* :mod:`scaletrain.eval.evaluate` - decode and score a split of a checkpoint (``scaletrain evaluate``);
* :mod:`scaletrain.eval.translate` - translate raw lines and line streams (``scaletrain translate``);
* :mod:`scaletrain.eval.in_training` - BLEU validation during training, the best checkpoint, early stopping;
* :mod:`scaletrain.eval.compare_models` - the papers' models trained for equal minutes, evaluated, compared
  (``scaletrain compare-models``).
"""
