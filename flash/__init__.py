"""LLM in a flash (Alizadeh et al., 2023) for SwiGLU models: FFN neurons from disk by a trained predictor.

costmodel.py      the read curve and the price of reading bundles against a whole layer (§2.2, §4.2)
(models/flash_records.py: a neuron's record, its gate row, up row and down column in int4: the kernel's and the bundles' layout)
bundles.py        the bundled FFN layout beside a weight store: each layer's records in chunks (§3.2)
reader.py         BundleReader: a layer's records of given neurons, or all of them, by direct reads (§3.2, §4.2)
predictor.py      the low-rank predictor per layer, fitted on the model's own activations (§3.1, Appendix B; train.py)
cache.py          the sliding-window neuron cache in a preallocated matrix with swap-delete (§3.1, §3.3)
weights.py        FlashWeights, FlashFFN: the target with each layer's FFN over its predicted, cached neurons
sparse_target.py  the same over a resident target's own tensors: `--draft flash`
"""
