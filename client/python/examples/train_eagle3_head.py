#!/usr/bin/env python3
"""Train a small EAGLE-3-style draft head for a few steps, straight from the stream.

The target model runs in hsx-server; this process never loads it. Each training
sample arrives verified from hsx.OnlineDataset with the EAGLE-3 capture set
(three auxiliary layers and the last layer) and the post-norm final state.

The head follows EAGLE-3's shape, reduced to what fits in an example: the three
auxiliary states are fused by a linear layer (3H -> H), concatenated with the
embedding of the next token, passed through one transformer layer, and trained
to predict the target model's next final-norm state (the lm_head input) with a
smooth-L1 loss. (A full trainer would add the target's lm_head and a
cross-entropy on its logits, and train for far longer.)

    python train_eagle3_head.py --server localhost:50051 --input samples.jsonl --steps 20
"""

import argparse
import json

import torch
from torch import nn

import hsx


class DraftHead(nn.Module):
    def __init__(self, hidden, vocab, aux_layers=3, heads=4):
        super().__init__()
        self.fuse = nn.Linear(aux_layers * hidden, hidden)
        self.embed = nn.Embedding(vocab, hidden)
        self.project = nn.Linear(2 * hidden, hidden)
        self.layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, batch_first=True, norm_first=True)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, aux, next_tokens):
        x = self.project(torch.cat([self.fuse(aux), self.embed(next_tokens)], dim=-1))
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.out(self.layer(x, src_mask=causal, is_causal=True))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="hsx-server address (repeatable)")
    parser.add_argument("--input", required=True, help="JSONL with input_ids (and loss_mask)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    samples = [json.loads(line) for line in open(args.input) if line.strip()]
    client = hsx.Client(args.server[0])
    info = client.model_info()
    hidden, vocab = info["hidden_size"], info["vocab_size"]
    capture = info["default_capture_ids"]  # EAGLE-3: {2, N/2, N-3, N}
    n = info["num_layers"]
    aux_ids = [c for c in capture if c < n]
    client.close()

    dataset = hsx.OnlineDataset(samples, args.server, concurrency=4, capture=capture, dtype="fp32",
                                final_norm=True)
    head = DraftHead(hidden, vocab, aux_layers=len(aux_ids))
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr)
    losses = []
    step = 0
    while step < args.steps:
        for item in dataset:  # an hsx.Sample: the keys and shapes of an hsx-dump file
            ids = item["token_ids"]
            if ids.numel() < 2:
                continue
            hs = item["hidden_states"].float()                     # [T, L, H]
            aux = hs[:-1, : len(aux_ids)].reshape(ids.numel() - 1, -1)  # positions 0..T-2
            target = item["final_norm_hidden_states"].float()[1:]  # the next position's lm_head input
            mask = item.get("loss_mask", torch.ones_like(ids))[1:].float().unsqueeze(-1)
            prediction = head(aux.unsqueeze(0), ids[1:].unsqueeze(0))[0]
            loss = (nn.functional.smooth_l1_loss(prediction, target, reduction="none") * mask).sum() / (
                mask.sum() * hidden).clamp_min(1.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
            print(f"step {step:3d}  tokens {ids.numel():4d}  loss {loss.item():.4f}", flush=True)
            if step >= args.steps:
                break
    first, last = sum(losses[:3]) / len(losses[:3]), sum(losses[-3:]) / len(losses[-3:])
    print(f"trained {step} steps from the stream: loss {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
    main()
