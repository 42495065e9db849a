"""DejaVu-style baseline: a low-rank MLP x [n_embd] -> r -> [n_blocks] (ReLU), trained with the
same importance-weighted BCE and the same data as the hashing predictor (hashing.train_model)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn


class MLPPredictor(nn.Module):
    def __init__(self, n_embd: int, n_blocks: int, rank: int, mean: np.ndarray, scale: np.ndarray):
        super().__init__()
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("scale", torch.as_tensor(scale, dtype=torch.float32))
        self.fc1 = nn.Linear(n_embd, rank)
        self.fc2 = nn.Linear(rank, n_blocks)

    def init_prior(self, logit: np.ndarray):
        with torch.no_grad():
            self.fc2.bias.copy_(torch.from_numpy(logit))
            self.fc2.weight.mul_(0.1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1((x - self.mean) * self.scale)))

    def size_bytes(self) -> int:
        """f32 parameters, as DejaVu ships them (the input standardisation included)."""
        return 4 * (sum(p.numel() for p in self.parameters()) + 2 * self.mean.numel())

    @torch.no_grad()
    def predict(self, x: np.ndarray) -> np.ndarray:
        return self(torch.as_tensor(np.asarray(x, dtype=np.float32))).numpy()
