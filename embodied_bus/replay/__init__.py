"""Recordings in and out (rosbag2 sqlite3 / MCAP, bare legacy .db3, ROS 1 bags, via rosbags)."""

from embodied_bus.replay.inspect import RecordingReport, TopicReport, inspect_recording
from embodied_bus.replay.reader import (
    RecordedMessage,
    RecordingError,
    RecordingInfo,
    SkippedTopic,
    modality_of,
    normalize_msgtype,
    read_recording,
    recording_info,
    topic_to_stream,
)

__all__ = [
    "RecordedMessage",
    "RecordingError",
    "RecordingInfo",
    "RecordingReport",
    "SkippedTopic",
    "TopicReport",
    "inspect_recording",
    "modality_of",
    "normalize_msgtype",
    "read_recording",
    "recording_info",
    "topic_to_stream",
]

from embodied_bus.replay.player import ReplayOptions, ReplaySummary, replay

__all__ += ["ReplayOptions", "ReplaySummary", "replay"]
