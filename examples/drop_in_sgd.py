"""The two-line change: torch_bigbatch's fused SGD (or LARS) in place of torch.optim.SGD.

Trains a small convnet on synthetic images (a template per class, plus noise) for a few steps with Goyal et al.'s parameter groups
(no weight decay on biases and BatchNorm), a per-iteration warmup and torch.amp.GradScaler,
and prints the loss. The recipe for ResNet-50 under torchrun is examples/train_resnet50.py.

    python examples/drop_in_sgd.py [--lars]
"""

import argparse

import torch
from torch import nn

import torch_bigbatch as bb


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lars", action="store_true", help="LARS instead of SGD")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 10)).to(device)
    labels = torch.randint(0, 10, (256,), device=device)
    templates = torch.randn(10, 1, 28, 28, device=device)
    images = templates[labels] + 0.5 * torch.randn(256, 1, 28, 28, device=device)

    groups = bb.optim.param_groups(model, weight_decay=1e-4)
    if args.lars:
        optimizer = bb.optim.LARS(groups, lr=2.0, momentum=0.9, trust_coefficient=0.02)
    else:
        optimizer = bb.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=10)
    scaler = torch.amp.GradScaler(device)

    for step in range(args.steps):
        optimizer.zero_grad()
        lr = optimizer.param_groups[0]["lr"]  # this step's (warmup.step() sets the next one's)
        loss = nn.functional.cross_entropy(model(images), labels, label_smoothing=0.1)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # the kernel unscales and skips on inf, without a host sync
        scaler.update()
        warmup.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}  lr {lr:.4f}")


if __name__ == "__main__":
    main()
