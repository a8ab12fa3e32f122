"""Re-creation (own code) of the usage pattern of huggingface/accelerate's examples/nlp_example.py:
``main()`` parses ``--cpu``/``--mixed_precision`` and calls a training function that builds an
``Accelerator``, data loaders, a model, AdamW and a linear warm-up schedule, hands all of them
to ``accelerator.prepare``, then per epoch trains (``accelerator.backward``, a step every
``gradient_accumulation_steps`` batches) and evaluates with ``gather_for_metrics``.
Synthetic token data instead of GLUE, a small embedding classifier instead of BERT.
"""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


class BagOfWords(torch.nn.Module):
    def __init__(self, vocab: int = 500, dim: int = 64, labels: int = 2) -> None:
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(vocab, dim)
        # Batch norm: running statistics are buffers, which DDP broadcasts every forward
        # (BERT's position ids in the original play the same part).
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.BatchNorm1d(dim),
                                       torch.nn.ReLU(), torch.nn.Linear(dim, labels))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids))


def loaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randint(0, 500, (1024, 24), generator=g),
                          torch.randint(0, 2, (1024,), generator=g))
    val = TensorDataset(torch.randint(0, 500, (64, 24), generator=g),
                        torch.randint(0, 2, (64,), generator=g))
    return (DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True),
            DataLoader(val, batch_size=32))


def training_function(config: dict, args: argparse.Namespace) -> None:
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    torch.manual_seed(config["seed"])
    accumulate = 1
    train_dl, eval_dl = loaders(config["batch_size"])
    model = BagOfWords()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    total = len(train_dl) * config["num_epochs"] // accumulate
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * max(0.0, 1 - s / total))
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(config["num_epochs"]):
        model.train()
        for i, (ids, labels) in enumerate(train_dl):
            loss = loss_fn(model(ids), labels) / accumulate
            accelerator.backward(loss)
            if i % accumulate == 0:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        right = seen = 0
        for ids, labels in eval_dl:
            with torch.no_grad():
                pred = model(ids).argmax(-1)
            pred, labels = accelerator.gather_for_metrics((pred, labels))
            right += int((pred == labels).sum())
            seen += len(labels)
        accelerator.print(f"epoch {epoch}: accuracy {right / max(1, seen):.3f}")
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description="accelerate training, example style")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    training_function({"lr": 1e-3, "num_epochs": 2, "seed": 42, "batch_size": 16}, args)


if __name__ == "__main__":
    main()
