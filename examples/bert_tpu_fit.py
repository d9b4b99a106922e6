"""Fine-tune a small BERT with `ds.Model.fit` under TPUStrategy, as TF's "BERT with
Model.fit and TPUStrategy" tutorial does with Keras.

    python examples/bert_tpu_fit.py                    # the default strategy, plain CPU
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .xla-venv/bin/python examples/bert_tpu_fit.py \\
        --strategy tpu [--spmd]      # TPUStrategy on 4 XLA CPU devices (see the README)

On a TPU host drop the two variables (torch_xla finds the TPU). Needs ``transformers``
(``pip install transformers``); nothing is downloaded: the model is
``BertForSequenceClassification`` from a tiny ``BertConfig`` (2 layers, width 64),
and the task is synthetic: does a sentence of random tokens hold more of token 5
than of token 6? Dropout is 0, so every strategy gives the same numbers (the XLA
lane's test compares the losses with the default strategy's). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification

import distribute as ds

VOCAB, LENGTH, PAD, YES, NO = 32, 24, 0, 5, 6


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (PAD after each sentence's end) and labels: 1 where the sentence holds
    more YES tokens than NO tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(PAD + 1, VOCAB, size=(n, LENGTH))
    lengths = rng.integers(LENGTH // 2, LENGTH + 1, size=n)
    ids[np.arange(LENGTH)[None, :] >= lengths[:, None]] = PAD
    labels = ((ids == YES).sum(1) > (ids == NO).sum(1)).astype(np.int64)
    return ids, labels


class BertClassifier(torch.nn.Module):
    """`BertForSequenceClassification` taking token ids (attending where they are not
    PAD) and returning the logits."""

    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=LENGTH,
            num_labels=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=PAD,
            attn_implementation="eager",  # what the additive mask below is for
        )
        self.bert = BertForSequenceClassification(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The additive 4D mask eager attention takes (0 where a token is, the float
        # minimum at padding), made here: from a 2D mask transformers first asks
        # whether anything is masked at all (`mask.all()`), a host read that on XLA
        # executes part of the graph in the middle of every step.
        padding = (input_ids == PAD)[:, None, None, :].float()
        mask = padding * torch.finfo(torch.float32).min
        logits: torch.Tensor = self.bert(input_ids=input_ids, attention_mask=mask).logits
        return logits


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=("default", "tpu"), default="default")
    parser.add_argument("--spmd", action="store_true", help="TPUStrategy as one SPMD program")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch")
    parser.add_argument("--steps-per-execution", type=int, default=4)
    args = parser.parse_args()

    if args.strategy == "tpu":
        # First, before any training in the process (torch_xla's runtime must be up
        # before autograd's first backward: ds.errors.XlaAutogradError says more).
        resolver = ds.cluster_resolver.TPUClusterResolver()
        ds.tpu.initialize_tpu_system(resolver)
        strategy = ds.TPUStrategy(resolver, experimental_spmd_xla_partitioning=args.spmd)
    else:
        strategy = ds.get_strategy()

    x_train, y_train = make_data(500, seed=0)  # 15 full batches of 32 and one of 20
    x_val, y_val = make_data(200, seed=1)

    torch.manual_seed(0)  # the same initial weights under every strategy
    with strategy.scope():
        model = ds.Model(BertClassifier())
        model.compile(
            optimizer=ds.optimizers.AdamW(model.parameters(), learning_rate=1e-3),
            loss=ds.training.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=args.steps_per_execution,
        )
    history = model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x_val, y_val),
        verbose=0,
    )
    predictions = model.predict(x_val, batch_size=args.batch_size, verbose=0)
    return {
        "strategy": type(strategy).__name__,
        "spmd": bool(args.spmd),
        "replicas_in_sync": strategy.num_replicas_in_sync,
        "loss": history.history["loss"],
        "val_loss": history.history["val_loss"],
        "val_accuracy": history.history["val_accuracy"],
        "predict_accuracy": float((predictions.argmax(1) == y_val).mean()),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
