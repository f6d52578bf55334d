"""The wire format of a sample, in one place: the binary header (:mod:`.header`), batches of
samples (:mod:`.batches`) and the header as Pulsar properties (:mod:`.properties`).

The layout is documented in ``docs/wire-format.md``.
"""

from embodied_bus.model.batches import (
    BATCH_LAYOUT,
    COLUMN_LAYOUT,
    HeaderRun,
    decode_batch,
    decode_batch_runs,
    encode_batch,
    encode_batch_parts,
    encode_column_batch,
    is_batch,
    split_batch,
)
from embodied_bus.model.header import (
    HEADER_STRUCT,
    MAX_NAME_BYTES,
    WIRE_MAGIC,
    WIRE_VERSION,
    Header,
    HeaderFlags,
    HeaderPacker,
    Modality,
    decode_header,
    encode_header,
    encode_strings,
    validate_stream_name,
    with_header_flags,
)
from embodied_bus.model.properties import (
    PROPERTY_LAYOUT,
    decode_properties,
    encode_header_text,
    encode_properties,
)

__all__ = [
    "BATCH_LAYOUT",
    "COLUMN_LAYOUT",
    "HEADER_STRUCT",
    "MAX_NAME_BYTES",
    "PROPERTY_LAYOUT",
    "WIRE_MAGIC",
    "WIRE_VERSION",
    "Header",
    "HeaderFlags",
    "HeaderPacker",
    "HeaderRun",
    "Modality",
    "decode_batch",
    "decode_batch_runs",
    "decode_header",
    "decode_properties",
    "encode_batch",
    "encode_batch_parts",
    "encode_column_batch",
    "encode_header",
    "encode_header_text",
    "encode_properties",
    "encode_strings",
    "is_batch",
    "split_batch",
    "validate_stream_name",
    "with_header_flags",
]
