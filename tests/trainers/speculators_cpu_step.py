"""speculators' own training entry point (speculators.train.cli.main, what
`speculators train` runs), run on the CPU, reporting what one optimizer step did.

    python speculators_cpu_step.py RESULT.json [speculators train flags ...]

speculators 0.9.0's Trainer assumes an accelerator in exactly two places; on a
machine without one (CI), and only there, this script replaces them:
  - the device: Trainer moves the model and each batch to `get_local_rank()`
    (the int 0, i.e. cuda:0); here "cpu".
  - `torch.accelerator.synchronize()` in its step timer, which initialises CUDA;
    here a no-op.
Everything else is speculators' own: the vocab mapping lookup and loading
(parse_vocab_mappings: DATA/d2t-{N}.npy, DATA/t2d-{N}.npy), the draft model
built from the verifier's config, the data loaders over DATA/hidden_states, the
optimizer, the EAGLE-3 loss (pass --loss-implementation eager: the fused loss is
a Triton kernel) and the step. Its autocast to the hidden-states dtype disables
itself without CUDA, so the step runs in float32.

RESULT.json receives: "losses" (the loss of each training forward), "changed" and
"unchanged" (trainable parameter names), "d2t" and "t2d_ids" (the model's
buffers after loading, t2d as the ids where it is true; null when speculators
found no mapping and trained on the full vocabulary, which it does with only a
warning)."""

import json
import sys

import torch
import speculators.train.trainer as trainer_module
from speculators.train.cli import main
from speculators.train.config import TrainConfig


def cpu_stand_ins():
    if torch.cuda.is_available():
        return
    trainer_module.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None


def record_one_epoch(result):
    """Wraps Trainer.train_epoch: parameters before and after, and every training forward's loss."""
    original = trainer_module.Trainer.train_epoch

    def train_epoch(self, epoch, **kwargs):
        model = self.model
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        forward = model.forward

        def recording_forward(*args, **kw):
            out = forward(*args, **kw)
            result["losses"].append(float(out[1].detach()))
            return out

        model.forward = recording_forward
        try:
            original(self, epoch, **kwargs)
        finally:
            model.forward = forward
        after = dict(model.named_parameters())
        result["changed"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
        result["unchanged"] = sorted(n for n in before if torch.equal(before[n], after[n]))
        loaded = model.d2t is not None and model.t2d is not None  # None: trained on the full vocabulary
        result["d2t"] = model.d2t.tolist() if loaded else None
        result["t2d_ids"] = model.t2d.nonzero().flatten().tolist() if loaded else None
        result["t2d_size"] = int(model.t2d.shape[0]) if loaded else None

    trainer_module.Trainer.train_epoch = train_epoch


if __name__ == "__main__":
    out, flags = sys.argv[1], sys.argv[2:]
    result = {"losses": []}
    cpu_stand_ins()
    record_one_epoch(result)
    sys.argv = ["speculators train", *flags]
    main(TrainConfig.resolve())
    with open(out, "w") as sink:
        json.dump(result, sink)
