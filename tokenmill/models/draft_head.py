"""`DraftHead`: what every draft head declares (DeepSeek's MTP layers, EAGLE-1 and EAGLE-3
heads), so the drafter asks the head rather than probing it: how it scores its drafts (the
target's LM head, or its own) and how it turns the target's hidden states into its input
rows."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class DraftHead(nn.Module):
    def logits(self, hidden: torch.Tensor,
               target_lm_head: Callable[[torch.Tensor], torch.Tensor | None]):
        """Scores over the target's vocabulary (default: the target's LM head, whose ranks
        other than 0 give None under tensor parallel)."""
        return target_lm_head(hidden)

    def target_features(self, target_hidden):
        """Head 0's input rows from what it reads of a target step (default: the target's
        final hidden states as they are)."""
        return target_hidden
