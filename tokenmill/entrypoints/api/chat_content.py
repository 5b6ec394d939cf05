"""A chat message's content parts as the chat template takes them: text parts joined into
one string; with an image-text model, `image_url` parts kept in place as `{"type":
"image"}` (the template writes the model's image token there), their URLs collected."""

from __future__ import annotations

from typing import Any

from tokenmill.sampling_params import InvalidParameter


def template_content(content: list[dict[str, Any]], images: list[str] | None
                     ) -> str | list[dict[str, Any]]:
    """`images`: where an image-text model's image URLs go, in order (None: a text model,
    which refuses image parts)."""
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "image_url" and images is not None:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise InvalidParameter("messages", "An image_url part needs image_url.url.")
            images.append(url)
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise InvalidParameter("messages", "Only text content parts are supported" + (
                " (and image_url ones)." if images is not None
                else ": this model takes no images."))
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)
