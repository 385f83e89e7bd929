"""Multimodal chat over real HTTP on a unified engine: greedy output equals transformers `generate`
for concurrent image requests of mixed sizes and formats (data URLs and a loopback http URL);
every kind of bad image gets a 400 naming its part; KV comes back after each test."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from servers import assert_kv_back_to_start, served

from splitserve.api.openai_protocol import ApiError, ImagePart, parse_chat
from splitserve.engine.checkpoints.tiny_llava import write_llava_checkpoint
from splitserve.engine.multimodal.image_inputs import ImageInputConfig, load_images
from splitserve.engine.multimodal.image_processor import ClipImageProcessor

transformers = pytest.importorskip("transformers")

MODEL = "llava"
MAX_IMAGE_BYTES = 60_000


def image(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode)


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


class ImageHandler(http.server.BaseHTTPRequestHandler):
    """Loopback image host: /ok.png, /huge.png (over the byte limit), /slow.png, /text, 404 otherwise."""

    files: dict[str, tuple[bytes, str]] = {}

    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path not in self.files:
            self.send_error(404)
            return
        body, kind = self.files[self.path]
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    ok = encoded(image(50, 34, seed=11), "PNG")
    ImageHandler.files = {"/ok.png": (ok, "image/png"), "/slow.png": (ok, "image/png"),
                          "/huge.png": (b"\x89PNG" + bytes(MAX_IMAGE_BYTES + 10), "image/png"),
                          "/text": (b"hello, not an image", "text/plain")}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", ok
    httpd.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_llava_checkpoint(tmp_path_factory.mktemp("llava"), seed=7)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory) -> str:
    # Chunks of 8 tokens cut through the 16-row images; small pages exercise the image-keyed prefix cache.
    with served(["--model", str(checkpoint), "--served-model-name", MODEL, "--page-size", "4",
                 "--chunked-prefill-size", "8", "--max-total-tokens", "4096", "--max-running-requests", "8",
                 "--device", "cpu", "--max-images-per-request", "3", "--max-image-bytes", str(MAX_IMAGE_BYTES),
                 "--max-image-pixels", "250000", "--image-fetch-timeout", "1"],
                tmp_path_factory.mktemp("log") / "server.log") as url:
        yield url


@pytest.fixture(autouse=True)
def kv_back_to_start(server: str):
    yield
    assert_kv_back_to_start(server)


def chat_body(parts: list[dict], max_tokens: int = 12) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def hf_greedy(checkpoint: Path, parts: list[dict], images: list[Image.Image], max_new: int) -> tuple[list, list]:
    """transformers' prompt ids and greedy tokens for the same content (images as decoded from the bytes). Its
    model gets the pixels of our ClipImageProcessor, which test_llava holds equal to transformers' on PIL: its
    torchvision backend (picked wherever torchvision is installed) resizes a little differently, and transformers
    5.17 drops alpha where 5.24 and ours composite over white."""
    proc = transformers.AutoProcessor.from_pretrained(checkpoint)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf_parts = [{"type": "image"} if p["type"] == "image_url" else p for p in parts]
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": hf_parts}], add_generation_prompt=True,
                                    tokenize=False)
    inputs = proc(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
    if images:
        ours = ClipImageProcessor.from_folder(checkpoint)
        inputs["pixel_values"] = torch.stack([ours(image) for image in images])
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                                           eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=config)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


def test_concurrent_image_requests_equal_transformers_generate(server: str, checkpoint: Path, image_host) -> None:
    host, host_png = image_host
    pics = {"wide": image(61, 29, 1), "tall": image(23, 70, 2, "RGBA"), "small": image(14, 18, 3),
            "big": image(120, 96, 4)}
    files = {"wide": encoded(pics["wide"], "PNG"), "tall": encoded(pics["tall"], "WEBP"),
             "small": encoded(pics["small"], "JPEG"), "big": encoded(pics["big"], "PNG")}
    url = {"wide": data_url(files["wide"], "image/png"), "tall": data_url(files["tall"], "image/webp"),
           "small": data_url(files["small"], "image/jpeg"), "big": data_url(files["big"], "image/png")}

    def img_part(u: str) -> dict:
        return {"type": "image_url", "image_url": {"url": u}}

    cases = [
        [{"type": "text", "text": "no image at all, just text"}],
        [img_part(url["wide"]), {"type": "text", "text": "describe"}],
        [img_part(url["tall"]), {"type": "text", "text": "describe"}],  # same text, another image: no KV shared
        [{"type": "text", "text": "two:"}, img_part(url["small"]), img_part(url["big"])],
        [img_part(url["wide"]), {"type": "text", "text": "describe it again"}],  # same image: cache hit
        [{"type": "text", "text": "fetched"}, img_part(f"{host}/ok.png")],
    ]
    decoded = {k: Image.open(io.BytesIO(v)) for k, v in files.items()}
    by_url = {url[k]: decoded[k] for k in url} | {f"{host}/ok.png": Image.open(io.BytesIO(host_png))}

    async def run_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(client.post(f"{server}/v1/chat/completions", json=chat_body(p))
                                          for p in cases))

    responses = asyncio.run(run_all())
    for parts, resp in zip(cases, responses, strict=True):
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        images = [by_url[p["image_url"]["url"]] for p in parts if p["type"] == "image_url"]
        want_prompt, want_tokens = hf_greedy(checkpoint, parts, images, 12)
        assert choice["prompt_token_ids"] == want_prompt
        assert choice["token_ids"] == want_tokens, parts
        assert resp.json()["usage"]["prompt_tokens"] == len(want_prompt)
    # Afterwards, the same image again hits the prefix cache (the image positions included).
    again = httpx.post(f"{server}/v1/chat/completions", json=chat_body(cases[1]), timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 20
    assert again["choices"][0]["token_ids"] == responses[1].json()["choices"][0]["token_ids"]


def bad_cases(host: str) -> list[tuple[str, dict, str]]:
    """(what is wrong, the bad part, the error code): each must get a 400 naming the part."""
    png = encoded(image(20, 20, 5), "PNG")
    gif = encoded(image(20, 20, 5), "GIF")
    bmp = encoded(image(20, 20, 5), "BMP")
    return [
        ("not base64", {"url": "data:image/png;base64,@@@notbase64@@@"}, "invalid_image"),
        ("no base64 marker", {"url": "data:image/png," + base64.b64encode(png).decode()}, "invalid_image"),
        ("unsupported mime", {"url": data_url(gif, "image/gif")}, "unsupported_image_type"),
        ("text mime", {"url": data_url(b"hello", "text/plain")}, "unsupported_image_type"),
        ("not an image", {"url": data_url(b"definitely not a png", "image/png")}, "invalid_image"),
        ("truncated png", {"url": data_url(png[: len(png) // 2], "image/png")}, "invalid_image"),
        ("bmp declared as png", {"url": data_url(bmp, "image/png")}, "unsupported_image_type"),
        ("empty data", {"url": "data:image/png;base64,"}, "invalid_image"),
        ("too many bytes", {"url": data_url(png + bytes(MAX_IMAGE_BYTES), "image/png")}, "image_too_large"),
        ("too many pixels", {"url": data_url(encoded(Image.new("RGB", (600, 600)), "PNG"), "image/png")},
         "image_too_large"),
        ("file scheme", {"url": "file:///etc/passwd"}, "unsupported_image_url"),
        ("missing url", {}, "invalid_image"),
        ("http 404", {"url": f"{host}/missing.png"}, "image_fetch_failed"),
        ("http not an image", {"url": f"{host}/text"}, "invalid_image"),
        ("http over the byte limit", {"url": f"{host}/huge.png"}, "image_too_large"),
        ("http timeout", {"url": f"{host}/slow.png"}, "image_fetch_failed"),
    ]


def test_every_kind_of_bad_image_gets_a_400_naming_its_part(server: str, image_host) -> None:
    host, _ = image_host
    good = {"type": "image_url", "image_url": {"url": data_url(encoded(image(30, 30, 6), "PNG"), "image/png")}}
    steps = httpx.get(f"{server}/internal/state").json()["steps"]
    for what, spec, code in bad_cases(host):
        parts = [good, {"type": "text", "text": "x"}, {"type": "image_url", "image_url": spec}]
        r = httpx.post(f"{server}/v1/chat/completions", json=chat_body(parts), timeout=30)
        assert r.status_code == 400, (what, r.text)
        err = r.json()["error"]
        assert err["param"] == "messages[0].content[2]", (what, err)
        assert err["code"] == code, (what, err)
    too_many = [good] * 4
    r = httpx.post(f"{server}/v1/chat/completions", json=chat_body(too_many), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images"
    assert r.json()["error"]["param"] == "messages[0].content[3]"
    # A placeholder count the template cannot pair, and an unknown part type.
    r = httpx.post(f"{server}/v1/chat/completions", json=chat_body([{"type": "audio", "audio": "x"}]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
    # No engine step ran for any of them: every image is checked before prefill work starts.
    assert httpx.get(f"{server}/internal/state").json()["steps"] == steps
    ok = httpx.post(f"{server}/v1/chat/completions", json=chat_body([good], max_tokens=2), timeout=60)
    assert ok.status_code == 200


def test_an_undecodable_image_is_named_by_its_part_without_object_reprs(server: str, image_host) -> None:
    """PIL's UnidentifiedImageError names the BytesIO it read (`<_io.BytesIO object at 0x...>`): the client
    gets which part it was and that it could not be decoded, and no Python object in the message."""
    host, _ = image_host
    png = encoded(image(20, 20, 5), "PNG")
    good = {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}
    for url in (data_url(b"definitely not a png", "image/png"), data_url(png[: len(png) // 2], "image/png"),
                f"{host}/text"):
        parts = [good, {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]
        r = httpx.post(f"{server}/v1/chat/completions", json=chat_body(parts), timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"].startswith("messages[0].content[2]: the image could not be decoded"), err
        assert " object at 0x" not in err["message"] and "<" not in err["message"], err
        assert err["param"] == "messages[0].content[2]" and err["code"] == "invalid_image"


def test_a_text_only_model_refuses_images_and_accepts_text_parts() -> None:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    with pytest.raises(ApiError) as err:
        parse_chat(body, "m", 300, 16, takes_images=False)
    assert err.value.status == 400 and err.value.code == "images_not_supported"
    assert err.value.param == "messages[0].content[1]"
    _, messages = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}]},
                             "m", 300, 16, takes_images=False)
    assert messages[0]["content"] == "ab"


def test_url_fetching_can_be_turned_off(image_host) -> None:
    host, _ = image_host
    cfg = ImageInputConfig(allow_image_urls=False)
    with pytest.raises(ApiError) as err:
        asyncio.run(load_images([ImagePart("messages[0].content[0]", url=f"{host}/ok.png")], cfg))
    assert err.value.code == "image_url_fetch_disabled" and err.value.param == "messages[0].content[0]"
    loaded = asyncio.run(load_images([ImagePart("p", url=f"{host}/ok.png")], ImageInputConfig()))
    assert loaded[0].image.size == (50, 34)
