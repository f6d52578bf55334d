"""Plain typed values with no I/O: headers, samples, bucket clocks, encodings."""

from embodied_bus.model.clock import DEFAULT_BUCKET_WIDTH_NS, BucketClock
from embodied_bus.model.encoding import ENCODING_NPY, ENCODING_RAW, decode_npy, encode_npy
from embodied_bus.model.header import (
    WIRE_VERSION,
    Header,
    HeaderFlags,
    Modality,
    decode_header,
    encode_header,
    validate_stream_name,
)
from embodied_bus.model.properties import decode_properties, encode_properties
from embodied_bus.model.sample import Payload, Sample

__all__ = [
    "DEFAULT_BUCKET_WIDTH_NS",
    "ENCODING_NPY",
    "ENCODING_RAW",
    "WIRE_VERSION",
    "BucketClock",
    "Header",
    "HeaderFlags",
    "Modality",
    "Payload",
    "Sample",
    "decode_header",
    "decode_npy",
    "decode_properties",
    "encode_header",
    "encode_npy",
    "encode_properties",
    "validate_stream_name",
]
