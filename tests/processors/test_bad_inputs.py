"""Bad rows: a clear error naming the row, or a counted skip when the config says to filter; never a hang,
never a truncated prompt."""

from __future__ import annotations

import http.server
import io
import os
import re
import struct
import threading
import time
import zlib

import pytest

from tests.processors.helpers import image_row, noise_image, png_bytes
from vlmrl.data.config import DataConfig
from vlmrl.processors.errors import BadRowError, FilteredRow
from vlmrl.processors.loading import load_processor

ROW = 42


@pytest.fixture(scope="module")
def processor(tiny_model_path):
    return load_processor(tiny_model_path)


@pytest.fixture(scope="module")
def filtering(tiny_model_path):
    return load_processor(tiny_model_path, DataConfig(on_bad_image="filter"))


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height (1-bit grey) with almost no data: what a decompression bomb
    looks like before decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _bad(processor, images, match, question="<image>What is it?"):
    with pytest.raises(BadRowError, match=match) as info:
        processor.build_request(image_row(question, images), index=ROW)
    assert info.value.row_index == ROW and str(info.value).startswith(f"row {ROW}:")
    assert not isinstance(info.value, FilteredRow)  # on_bad_image="error": a failure, not a skip
    return info.value


def test_corrupt_bytes(processor):
    _bad(processor, [{"bytes": b"this is not an image"}], "not a readable image")


def test_truncated_image(processor):
    data = png_bytes(noise_image(200, 200))
    _bad(processor, [{"bytes": data[: len(data) // 2]}], "corrupt or truncated")


def test_missing_file(processor, tmp_path):
    _bad(processor, [{"path": str(tmp_path / "nope.png")}], "image file not found")


def test_zero_size_bytes_and_file(processor, tmp_path):
    _bad(processor, [{"bytes": b""}], r"empty \(0 bytes\)")
    (tmp_path / "empty.png").write_bytes(b"")
    _bad(processor, [str(tmp_path / "empty.png")], r"empty \(0 bytes\)")


def test_zero_size_pil_image(processor):
    from PIL import Image

    _bad(processor, [Image.new("RGB", (0, 10))], "zero size")


@pytest.mark.parametrize("num_images,question", [(2, "<image>One marker."), (0, "<image>One marker."),
                                                  (1, "No marker at all.")])
def test_image_count_differs_from_placeholders(processor, num_images, question):
    images = [noise_image(60, 60, seed=i) for i in range(num_images)]
    _bad(processor, images, f"1 image placeholders in the prompt but {num_images} images" if "<image>" in question
         else f"0 image placeholders in the prompt but {num_images} images", question=question)


def test_literal_image_pad_in_the_text(processor):
    _bad(processor, [noise_image(60, 60)], re.escape("holds 2 <|image_pad|> tokens for 1 images"),
         question="<image>what does <|image_pad|> mean?")


def test_paths_may_not_leave_the_data_root(tiny_model_path, tmp_path):
    root, outside = tmp_path / "data", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    data = png_bytes(noise_image(60, 60))
    (root / "in.png").write_bytes(data)
    (outside / "secret.png").write_bytes(data)
    os.symlink(outside / "secret.png", root / "link.png")
    processor = load_processor(tiny_model_path, DataConfig(data_root=str(root)))
    assert processor.build_request(image_row("<image>?", ["in.png"]), ROW).images  # relative, inside: fine
    for escaping in ["../outside/secret.png", str(outside / "secret.png"), "link.png",
                     {"path": "../outside/secret.png"}]:
        _bad(processor, [escaping], "resolves outside data_root")


def test_remote_url_refused_unless_allowed(processor):
    error = _bad(processor, ["https://example.com/cat.png"], "remote image URL")
    assert "allow_remote_images" in str(error)  # says what to change


class _Server:
    """A local HTTP server (loopback only) serving a good image, an oversized one, one that never answers and one
    that trickles a byte at a time."""

    def __init__(self, image: bytes):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path == "/trickle":  # one byte every 0.5 s, 16 at most: ends by itself within 8 s
                    return self._trickle()
                if self.path == "/slow":
                    time.sleep(3)
                body = image if self.path != "/big" else b"\0" * (2 * 1024 * 1024)
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up first (timeout, size limit): what the test wants

            def _trickle(self):
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(image)))
                    self.end_headers()
                    for byte in image[:16]:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.5)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_remote_images_when_allowed_have_a_timeout_and_a_size_limit(tiny_model_path):
    image = noise_image(90, 60, seed=9)
    server = _Server(png_bytes(image))
    try:
        processor = load_processor(tiny_model_path, DataConfig(
            allow_remote_images=True, remote_timeout_s=0.5, remote_max_bytes=1024 * 1024))
        fetched = processor.build_request(image_row("<image>?", [f"{server.url}/ok"]), ROW)
        local = processor.build_request(image_row("<image>?", [image]), ROW)
        assert fetched.image_hashes == local.image_hashes
        _bad(processor, [f"{server.url}/big"], "bytes")
        start = time.monotonic()
        _bad(processor, [f"{server.url}/slow"], "cannot fetch remote image")
        assert time.monotonic() - start < 2.5  # gave up at our timeout instead of waiting for the server
    finally:
        server.close()


def test_remote_timeout_bounds_the_whole_download_not_each_read(tiny_model_path):
    server = _Server(png_bytes(noise_image(90, 60, seed=9)))
    try:
        processor = load_processor(tiny_model_path, DataConfig(allow_remote_images=True, remote_timeout_s=1.0))
        start = time.monotonic()
        # every read gets a byte within 0.5 s (under the timeout): only a deadline for the whole body ends it
        _bad(processor, [f"{server.url}/trickle"], "remote_timeout_s=1.0")
        assert time.monotonic() - start < 2.5
    finally:
        server.close()


def test_decompression_bomb_rejected_before_decoding(processor):
    # 12000 x 12000 = 144 M pixels: over our 89.5 M limit, under PIL's own hard error (2x its warning threshold)
    _bad(processor, [{"bytes": _png_header_only(12_000, 12_000)}], "decompression-bomb guard")
    # far beyond: PIL's own guard fires while reading the header; still a row error
    _bad(processor, [{"bytes": _png_header_only(100_000, 100_000)}], "decompression")


def test_pixel_limit_is_configurable(tiny_model_path):
    # resized to at most 84 x 84 = 7056 pixels: a guard below the resize bound would be refused (see test_processor)
    processor = load_processor(tiny_model_path, DataConfig(max_pixels=84 * 84, max_image_pixels=100 * 100))
    assert processor.build_request(image_row("<image>?", [noise_image(100, 100)]), ROW).images
    _bad(processor, [noise_image(101, 100)], "max_image_pixels=10000")


def test_extreme_aspect_ratio(processor):
    _bad(processor, [noise_image(2000, 5)], "aspect ratio")


def test_of_a_rows_images_a_resize_error_names_the_bad_ones_source(processor, tmp_path):
    (tmp_path / "fine.png").write_bytes(png_bytes(noise_image(60, 60)))
    (tmp_path / "sliver.png").write_bytes(png_bytes(noise_image(2000, 5)))
    _bad(processor, [str(tmp_path / "fine.png"), str(tmp_path / "sliver.png")],
         f"^row {ROW}: image 1: cannot resize image file {re.escape(str(tmp_path / 'sliver.png'))} .*aspect ratio",
         question="<image><image>Which is wider?")
    # bytes carrying their path (the HF datasets form) are named by it
    _bad(processor, [{"bytes": png_bytes(noise_image(60, 60))}, {"bytes": png_bytes(noise_image(71, 1)),
                                                                 "path": "slivers/71x1.png"}],
         rf"^row {ROW}: image 1: image bytes \(slivers/71x1.png\) \(71x1\) resizes to",
         question="<image><image>Which is wider?")


def test_bad_images_are_counted_skips_when_filtering(filtering):
    for images in ([{"bytes": b"junk"}], [noise_image(30, 30), noise_image(30, 30)], ["https://example.com/a.png"]):
        with pytest.raises(FilteredRow) as info:
            filtering.build_request(image_row("<image>?", images), index=ROW)
        assert info.value.row_index == ROW and info.value.reason


def test_overlong_prompt_filtered_or_rejected_counting_image_tokens(tiny_model_path):
    image = noise_image(112, 112)  # 16 image tokens once expanded
    row = image_row("<image>How many?", [image])
    probe = load_processor(tiny_model_path, DataConfig(max_prompt_length=4096)).build_request(row)
    unexpanded = len(probe.prompt_ids)
    expanded = unexpanded - 1 + 16
    # the limit counts EXPANDED tokens: a prompt whose text fits but whose image does not is over the limit
    for filtered, error in ((True, FilteredRow), (False, BadRowError)):
        processor = load_processor(tiny_model_path, DataConfig(max_prompt_length=expanded - 1,
                                                                    filter_overlong_prompts=filtered))
        with pytest.raises(error, match=f"prompt is {expanded} tokens .* > max_prompt_length={expanded - 1}") as info:
            processor.build_request(row, index=ROW)
        assert info.value.row_index == ROW
        assert isinstance(info.value, FilteredRow) == filtered
    # at exactly the limit it passes, whole: every image placeholder kept
    fits = load_processor(tiny_model_path, DataConfig(max_prompt_length=expanded)).build_request(row)
    assert fits.prompt_ids == probe.prompt_ids and len(fits.images) == 1


def test_prompt_must_be_messages_or_text(processor):
    with pytest.raises(BadRowError, match="prompt must be"):
        processor.build_request({"prompt": None}, index=ROW)


@pytest.mark.parametrize("size", [(71, 1), (1, 71)])
def test_a_size_the_engines_would_resize_again_is_refused_by_row(processor, size):
    """qwen-vl-utils turns a 71x1 sliver into 476x28 (over the tiny model's max_pixels 12544); transformers' processor,
    which the engines and the trainer's pixel values use, would make it 448x28: one token fewer than the request."""
    _bad(processor, [noise_image(*size)], r"resizes to .* but the engines' image processor resizes it again")


def test_video_markers_and_videos_must_match_not_sent_as_text(processor):
    _bad(processor, [], "1 video placeholders in the prompt but 0 videos", question="<video>What happens?")
    with pytest.raises(BadRowError, match="0 video placeholders in the prompt but 1 videos"):
        processor.build_request(dict(image_row("What happens?", []), videos=[{"path": "clip.mp4"}]), index=ROW)


def test_content_part_prompts_from_parquet_carry_their_images_inline(processor, tmp_path):
    """Parquet gives every content part every struct field (a text part gets image=None); the inline image is used
    when the `images` column is empty, and one given in both places is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmrl.data.dataset import RLDataset

    image = noise_image(56, 56)
    row = {"data_source": "parts", "reward_model": {"ground_truth": "red"}, "images": [],
           "prompt": [{"role": "user", "content": [{"type": "image", "image": png_bytes(image)},
                                                   {"type": "text", "text": "What colour?"}]}]}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "parts.parquet")
    loaded = RLDataset([str(tmp_path / "parts.parquet")])[0]
    assert loaded["prompt"][0]["content"][1]["image"] is None  # what pyarrow hands back
    request = processor.build_request(loaded, index=0)
    assert len(request.images) == 1 and request.prompt_ids.count(processor.image_token_id) == 1
    direct = processor.build_request(row, index=0)
    assert request.prompt_ids == direct.prompt_ids and request.image_hashes == direct.image_hashes
    with pytest.raises(BadRowError, match="both in the `images` column"):
        processor.build_request(dict(row, images=[image]), index=ROW)


def test_vector_formats_are_not_decoded(processor):
    """PIL recognises EPS and would run Ghostscript on it where installed: dataset bytes are read as raster only."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n%%EOF\n"
    _bad(processor, [{"bytes": eps}], "is not a readable image")
    jpeg = io.BytesIO()
    noise_image(56, 56).save(jpeg, format="JPEG")
    assert processor.build_request(image_row("<image>?", [{"bytes": jpeg.getvalue()}]), ROW).images
