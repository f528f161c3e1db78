"""Token data, the global sample order, and the resumable step sampler: the ``data.*`` keys and what reads and
writes token files.  One module per job, each public name re-exported here (``from dettrain.data import
StepSampler``):

- tokens.py: ``DataConfig`` (the ``data.*`` keys), the embedded corpus, reading a token file through its sidecar;
- fingerprint.py: the data's identity in the ledger header, which a resume compares;
- sampler.py: the sample order of each epoch, ``StepSampler`` (resumes mid-epoch) and the ``ValidationSet``;
- documents.py and tokenize.py: ``prepare`` (``python -m dettrain.data prepare``), documents to a token file.
"""

from dettrain.data.documents import DATASET_MARKERS, JSONL_SUFFIXES, PARQUET_SUFFIXES, expand_inputs, input_kind
from dettrain.data.fingerprint import (
    CHUNK_BYTES,
    FULL_HASH_BYTES,
    SAMPLE_CHUNKS,
    data_fingerprint,
    file_fingerprint,
    fingerprint_changes,
)
from dettrain.data.sampler import (
    MicroBatch,
    SampleDataset,
    StepSampler,
    ValidationSet,
    epoch_order,
    micro_indices,
    split_samples,
)
from dettrain.data.tokenize import (
    BATCH_CHARS,
    BATCH_DOCS,
    BOS_NAMES,
    BYTE_EOT,
    EOT_NAMES,
    PAD_NAMES,
    PROBE_TEXT,
    check_output,
    load_tokenizer,
    prepare,
    tokenizer_sha256,
)
from dettrain.data.tokens import (
    DataConfig,
    check_same_format,
    load_tokens,
    sidecar,
    sidecar_vocab_size,
    stdlib_corpus,
    stdlib_sources,
)

__all__ = [
    "BATCH_CHARS", "BATCH_DOCS", "BOS_NAMES", "BYTE_EOT", "CHUNK_BYTES", "DATASET_MARKERS", "EOT_NAMES",
    "FULL_HASH_BYTES", "JSONL_SUFFIXES", "PAD_NAMES", "PARQUET_SUFFIXES", "PROBE_TEXT", "SAMPLE_CHUNKS", "DataConfig",
    "MicroBatch", "SampleDataset", "StepSampler", "ValidationSet", "check_output", "check_same_format",
    "data_fingerprint", "epoch_order", "expand_inputs", "file_fingerprint", "fingerprint_changes", "input_kind",
    "load_tokenizer", "load_tokens", "micro_indices", "prepare", "sidecar", "sidecar_vocab_size", "split_samples",
    "stdlib_corpus", "stdlib_sources", "tokenizer_sha256",
]
