"""The one exception family packtool raises for problems a user can fix.

Every message says what went wrong, where, and which flag or action fixes it.
The CLI turns these into ``Error: ...`` and a non-zero exit; anything else that
escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "PacktoolError",
    "InputError",
    "NoOutputError",
    "ConfigError",
    "OutputError",
    "ResumeMismatchError",
    "TooManyErrorsError",
    "OversizeSampleError",
    "SampleError",
    "REASON_CODES",
    "quoted",
]

#: Reason codes written to ``.packtool/errors.jsonl``; each names one way an input row can be rejected.
REASON_CODES: dict[str, str] = {
    "bad_json": "the line or record is not valid JSON",
    "bad_encoding": "the line or a text field is not valid UTF-8",
    "corrupt_file": "a compressed or Parquet input file breaks off or is not what its name says",
    "bad_record": "the record lacks required fields or has the wrong types",
    "empty_conversation": "the record has no conversation turns",
    "unknown_role": "a turn has a role the template does not know",
    "bad_turn_order": "the conversation breaks the template's turn order",
    "no_loss": "no assistant turn, so the sample would carry no loss",
    "bad_tools": "the sample's tools list is not a list of function schemas",
    "bad_tool_call": "a tool call is not a JSON object with a function name",
    "bad_tool_arguments": "a tool call's arguments are not a JSON object",
    "orphan_tool_result": "a tool result has no tool call before it to answer",
    "tools_unsupported": "the sample uses tools, which the template's model has no format for",
    "reasoning_unsupported": "the sample has reasoning_content, which the template's model has no format for",
    "placeholder_mismatch": "the number of <image>/<video> tags differs from the number of media",
    "missing_media": "a media file does not exist, or its path is a directory or other non-file",
    "path_outside_root": "a media path escapes --media-root",
    "unsupported_media": "a media file is in a format packtool does not open (e.g. EPS, PDF, a playlist)",
    "corrupt_image": "the image header cannot be read or the file is truncated",
    "image_too_large": "the image exceeds Pillow's decompression-bomb limit",
    "bad_aspect_ratio": "the image's aspect ratio is beyond what the model family accepts",
    "corrupt_video": "the video cannot be opened or has no decodable video stream",
    "video_too_short": "the video has fewer frames than the model family's processor accepts",
    "media_changed": "a media file differs from the one tokenize counted (size, or modification time)",
    "oversize": "the sample needs more tokens or vision units than one pack holds",
}


def quoted(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for a message that shows a value an input row
    held: a 20,000-character role or tool-call id would make as long a line in errors.jsonl.

    Example:
        >>> quoted("narrator"), quoted("x" * 100, limit=12)
        ("'narrator'", "'xxxxxxxxxx…")
    """
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class PacktoolError(Exception):
    """Base class: a problem the user can fix; the message says how."""

    exit_code = 1


class InputError(PacktoolError):
    """An input file or directory cannot be used as given."""


class NoOutputError(InputError):
    """A path holds no packtool output at all (missing, empty, no manifest, run state or shard):
    there is nothing to read or check, only a run to make."""


class ConfigError(PacktoolError):
    """A flag or a combination of flags is invalid."""


class OutputError(PacktoolError):
    """The output directory cannot be written as asked."""


class ResumeMismatchError(PacktoolError):
    """An output directory holds a run made with a different configuration."""


class TooManyErrorsError(PacktoolError):
    """More input rows were rejected than ``--max-errors`` allows."""


class OversizeSampleError(PacktoolError):
    """A sample cannot fit in any pack and the oversize policy is ``fail``."""


class SampleError(Exception):
    """One input row cannot become a sample; it is recorded, not raised to the user.

    Args:
        reason: a key of :data:`REASON_CODES`.
        message: what exactly is wrong with this row.
    """

    def __init__(self, reason: str, message: str) -> None:
        if reason not in REASON_CODES:
            raise RuntimeError(f"internal error: unknown reason code {reason!r}")
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __reduce__(self):
        # pickled with both arguments: one raised in a worker process reaches the driver as
        # itself (the default pickles ``args``, the message alone, which cannot rebuild it)
        return type(self), (self.reason, self.message)
