"""What the hsx-server tests share: the tiny model's shape, the server's limits as they start it,
an Extract stream split into its parts and its tensors reassembled (order, whole rows and sizes
checked), the trailer's checksums checked by the xxhash package, and waiting on the metrics."""

import random
import struct
import time

import grpc
import pytest
import xxhash

N_LAYERS = 8  # the tiny preset
HIDDEN = 128
VOCAB = 2048
EAGLE3 = [2, 4, 5, 8]
MAX_CHUNK = 10000  # not a multiple of a row: chunks must still hold whole rows
MAX_TOKENS = 1024
DTYPE_SIZE = {1: 2, 2: 2, 3: 4}
DTYPE_NAME = {1: "bf16", 2: "fp16", 3: "fp32"}

LONG = 2048  # tokens; capture all + final norm in fp32: 10 x 2048 x 128 x 4 B = 10 MiB per response

# A client that stops reading: without BDP probing the HTTP/2 stream window stays
# at 1 MiB, so the client's transport cannot soak up whole responses on its own.
STALLING_CLIENT = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1 << 20)]


# The server's checksums are checked by an implementation other than its own: the xxhash
# package's (the spec: github.com/Cyan4973/xxHash, doc/xxhash_spec.md).
def xxh64(data: bytes, seed: int = 0) -> int:
    """XXH64 from the xxhash package (the reference C implementation), not ours."""
    return xxhash.xxh64(data, seed=seed).intdigest()


def token_hash(ids):
    return xxh64(struct.pack(f"<{len(ids)}q", *ids))


def random_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def read_stream(call):
    """Splits an Extract response stream into (header, chunks, summary, trailer), checking the order."""
    header, chunks, summary, trailer = None, [], None, None
    for message in call:
        part = message.WhichOneof("part")
        assert trailer is None, "message after the trailer"
        if part == "header":
            assert header is None and not chunks and summary is None
            header = message.header
        else:
            assert header is not None, f"{part} before the header"
            if part == "chunk":
                assert summary is None
                chunks.append(message.chunk)
            elif part == "summary":
                assert summary is None and not chunks
                summary = message.summary
            else:
                trailer = message.trailer
    assert trailer is not None, "stream ended without a trailer"
    return header, chunks, summary, trailer


def reassemble(header, chunks, max_chunk_bytes):
    """{capture_id: bytes of [T, H]}, checking chunk order, whole rows and sizes."""
    size = DTYPE_SIZE[header.dtype]
    row_bytes = header.hidden_size * size
    rows_per_chunk = max_chunk_bytes // row_bytes
    order = list(header.capture_ids) + ([-1] if header.final_norm else [])
    tensors, seen = {}, []
    for chunk in chunks:
        if not seen or seen[-1] != chunk.capture_id:
            assert chunk.capture_id not in tensors, f"capture id {chunk.capture_id} split up"
            seen.append(chunk.capture_id)
            tensors[chunk.capture_id] = bytearray()
        data = tensors[chunk.capture_id]
        assert chunk.first_row * row_bytes == len(data), "rows missing or out of order"
        assert chunk.num_rows >= 1
        assert len(chunk.data) == chunk.num_rows * row_bytes, "not whole rows"
        assert len(chunk.data) <= max_chunk_bytes, "chunk over --max-chunk-bytes"
        last = chunk.first_row + chunk.num_rows == header.num_tokens
        assert last or chunk.num_rows == rows_per_chunk, "a chunk other than the last is not full"
        data += chunk.data
    assert seen == order, f"tensors in order {seen}, expected {order}"
    for cid, data in tensors.items():
        assert len(data) == header.num_tokens * row_bytes, f"capture id {cid}: wrong size"
    return {cid: bytes(data) for cid, data in tensors.items()}


def check_trailer(header, trailer, tensors, ids, xxh3=False):
    """The token hash, and each tensor's checksum by the xxhash package: XXH64 (the default) or,
    when the request asked for it (xxh3), XXH3-64 with the XXH64 fields left unset."""
    assert trailer.token_ids_xxh64 == header.token_ids_xxh64 == token_hash(ids)
    assert header.checksum == (2 if xxh3 else 1)  # CHECKSUM_XXH3_64, CHECKSUM_XXH64: always named
    assert [c.capture_id for c in trailer.checksums] == list(tensors)
    for checksum in trailer.checksums:
        data = tensors[checksum.capture_id]
        if xxh3:
            assert checksum.xxh3_64 == xxhash.xxh3_64(data).intdigest(), f"capture id {checksum.capture_id}"
            assert checksum.xxh3_64_hex == f"{checksum.xxh3_64:016x}"
            assert checksum.xxh64 == 0 and checksum.xxh64_hex == ""
        else:
            assert checksum.xxh64 == xxh64(data), f"capture id {checksum.capture_id}"
            assert checksum.xxh3_64 == 0 and checksum.xxh3_64_hex == ""


def scrape(server):
    return server.scrape()


def wait_for(predicate, timeout=20, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def error_of(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value
