"""hsx: verified hidden states from hsx-server, for training speculative-decoding draft models.

    import hsx
    client = hsx.Client("localhost:50051")
    sample = client.extract([1, 2, 3])          # hidden_states [T, L, H], token_ids [T]
    for index, sample in client.extract_many(token_lists, concurrency=8): ...

    dataset = hsx.OnlineDataset(samples, ["host-a:50051", "host-b:50051"])   # torch IterableDataset
    # (shared over ranks x DataLoader workers; hsx.integrations: inside each trainer's own loop)
    sample = hsx.read_sample("out/hs_0.safetensors")                         # hsx-dump files

All three give the same hsx.Sample: a dict of the file's tensor names
(hidden_states [T, L, H], token_ids [T], loss_mask [T] when known,
final_norm_hidden_states [T, H] when extracted) with .capture_ids, .sample_id,
.index and .metadata (see hsx.sample).

Every sample is checked before it is returned (token-id hash, shapes, per-tensor
checksums (XXH3 or XXH64), finite values, no all-zero layer); a failed check raises
IntegrityError, never returns data. Streams are received by the native module
hsx._native where it was built, else by grpcio (hsx.Client's `native`).
"""

from .client import Client, ServerError
from .files import read_sample
from .sample import Sample
from .stream_decoder import IntegrityError, StreamDecoder, StreamExpectation

__all__ = ["Client", "IntegrityError", "Sample", "ServerError", "StreamDecoder", "StreamExpectation", "read_sample",
           "OnlineDataset"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name == "OnlineDataset":  # needs torch; imported on first use
        from .dataset import OnlineDataset
        return OnlineDataset
    raise AttributeError(name)
