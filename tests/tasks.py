"""Small data sets the suites train on, kept with the tests.

`copy_task_data` is the copying task of the train chapter's first run: each sequence is a random half followed by the
same half again, so the second half can only be predicted by attending back. The suites import it as
``from tasks import copy_task_data`` (pytest puts tests/ on the path).
"""
from __future__ import annotations
import numpy as np

from oelm_nb.data import TokenData


def copy_task_data(n_seqs: int = 512, half: int = 16, vocab: int = 64, seed: int = 0) -> TokenData:
    "Token data made of random halves repeated once; recall positions mark the repeated half."
    rng = np.random.default_rng(seed)
    a = rng.integers(1, vocab, size=(n_seqs, half))
    seqs = np.concatenate([np.zeros((n_seqs, 1), dtype=np.int64), a, a], axis=1)   # 0 = separator
    rec = np.zeros_like(seqs); rec[:, half + 1:] = half
    return TokenData(tokens=seqs.reshape(-1).astype(np.uint16), recall=rec.reshape(-1).astype(np.uint16), vocab_size=vocab,
                     meta={'source': 'copy-task'})
