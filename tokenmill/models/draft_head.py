"""`DraftHead`: what every draft head declares (DeepSeek's MTP layers, EAGLE-1 and EAGLE-3
heads), so the drafter asks the head rather than probing it: whether it scores with an LM
head of its own, and how it turns the target's hidden states into its input rows."""

from __future__ import annotations

import torch
from torch import nn


class DraftHead(nn.Module):
    own_lm_head = False  # True: `logits` scores (EAGLE-3); False: the target's LM head does

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} scores with the target's LM head.")

    def target_features(self, target_hidden):
        """Head 0's input rows from what it reads of a target step (default: the target's
        final hidden states as they are)."""
        return target_hidden
