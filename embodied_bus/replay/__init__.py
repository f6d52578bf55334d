"""Recordings in (rosbag2 sqlite3 / MCAP, bare legacy .db3, ROS 1 bags, via rosbags)."""

from embodied_bus.replay.reader import (
    RecordedMessage,
    RecordingError,
    SkippedTopic,
    modality_of,
    normalize_msgtype,
    read_recording,
    topic_to_stream,
)

__all__ = [
    "RecordedMessage",
    "RecordingError",
    "SkippedTopic",
    "modality_of",
    "normalize_msgtype",
    "read_recording",
    "topic_to_stream",
]
