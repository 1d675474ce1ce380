"""A small generated text corpus for the word-level language-model example: no download, the same
tokens on every machine for a seed.

The "language" is a sparse random bigram chain over ``vocab`` words: each word is followed by one
of ``branching`` successors, with Zipf-like probabilities, and a full stop ends a sentence now and
then. An LSTM can learn it, and the chain's entropy is the perplexity floor (:func:`floor`), so a
run's result can be judged against the best possible one.
"""

from __future__ import annotations

import math

import torch


class Corpus:
    """Train, validation and test token streams (1-d int64 tensors) over ``vocab`` words."""

    def __init__(self, tokens: int = 120_000, vocab: int = 400, branching: int = 6, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.successors = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])
        weights = 1.0 / torch.arange(1, branching + 1, dtype=torch.float64)
        self.probs = weights / weights.sum()
        stream = self._walk(tokens, g)
        n_valid = n_test = tokens // 10
        self.train = stream[: tokens - n_valid - n_test]
        self.valid = stream[tokens - n_valid - n_test : tokens - n_test]
        self.test = stream[tokens - n_test :]

    def _walk(self, tokens: int, g: torch.Generator, chains: int = 200) -> torch.Tensor:
        """``chains`` walks side by side (one Python step per position, not per token), laid end to end."""
        length = -(-tokens // chains)
        choices = torch.multinomial(self.probs.float(), chains * length, replacement=True, generator=g)
        choices = choices.view(length, chains)
        words = torch.randint(self.vocab, (chains,), generator=g)
        out = torch.empty(length, chains, dtype=torch.long)
        for t in range(length):
            words = self.successors[words, choices[t]]
            out[t] = words
        return out.t().reshape(-1)[:tokens]

    def floor(self) -> float:
        """The chain's perplexity: what a perfect model of it scores."""
        entropy = -float((self.probs * self.probs.log()).sum())
        return math.exp(entropy)
