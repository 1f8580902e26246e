"""Chat content parts other than text: refused by name, before the request's types are checked.

pdserve serves text-only models. A message whose content holds an image, audio, video or file
part (`{"type": "image_url", ...}`, as OpenAI's and vLLM's multimodal APIs send them) is a 400
that says so and names the part, `messages[0].content[1].type`, instead of the type error
pydantic would give (the schema's content is text or text parts: router/api/schemas.py).
Other part types (unknown ones, a text part without its text) are left to the schema.
"""

from __future__ import annotations

from typing import Any

from pdserve.router.errors import invalid

MEDIA_PART_TYPES = frozenset({
    "image_url", "input_image", "image", "image_embeds", "image_pil",
    "input_audio", "audio_url", "audio",
    "video_url", "video",
    "file", "input_file",
})


def check_text_only(body: dict[str, Any]) -> None:
    """400 naming the first media part in `body`'s messages (routes with `messages`)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            part_type = part.get("type") if isinstance(part, dict) else None
            if isinstance(part_type, str) and part_type in MEDIA_PART_TYPES:
                raise invalid(
                    f"Content parts of type '{part_type}' are not supported: this server "
                    "serves text-only models, so message content must be text (a string or "
                    "parts of type 'text').",
                    f"messages[{index}].content[{part_index}].type",
                )
