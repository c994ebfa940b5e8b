"""Planted data: synthetic interactions with a known low-rank truth (`PlantedModel`), so a test
knows the best error a model can reach.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from tfdp.errors import DataError


@dataclasses.dataclass
class PlantedModel:
  """The true parameters of `planted_interactions`: the best any model can do on its data."""
  mean: float
  user_bias: np.ndarray  # [num_users]
  item_bias: np.ndarray  # [num_items]
  user_factors: np.ndarray  # [num_users, rank]
  item_factors: np.ndarray  # [num_items, rank]
  noise_sigma: float

  def predict(self, users, items) -> np.ndarray:
    """The noise-free rating of each (user, item) pair."""
    users, items = np.asarray(users), np.asarray(items)
    return (self.mean + self.user_bias[users] + self.item_bias[items]
            + np.sum(self.user_factors[users] * self.item_factors[items], axis=-1))

  def scores(self, users) -> np.ndarray:
    """[len(users), num_items] noise-free ratings of every item: the ideal ranking scores."""
    users = np.asarray(users)
    return (self.mean + self.user_bias[users, None] + self.item_bias[None, :]
            + self.user_factors[users] @ self.item_factors.T)


def planted_interactions(num_users: int, num_items: int, rank: int, noise_sigma: float,
                         interactions_per_user: int, seed: int, implicit: bool = False, *,
                         mean: float = 3.5, bias_sigma: float = 0.5
                         ) -> tuple[pd.DataFrame, PlantedModel]:
  """Synthetic interactions with a known low-rank truth, so a test knows the best achievable
  error: RMSE σ (the noise) for ratings.

  Factors have entries ~ N(0, variance 1/sqrt(rank)), so p_u·q_i has variance 1 for any rank;
  biases ~ N(0, bias_sigma²). Explicit: each user rates interactions_per_user distinct items
  drawn uniformly, rating = mean + b_u + b_i + p_u·q_i + N(0, σ²) (continuous: not rounded or
  clipped, which would move the floor). Implicit: each user's positives are the items with the
  top b_i + p_u·q_i + N(0, σ²) (likelier the higher the true score), label 1.0.
  Rows are sorted by user, then item.
  """
  if min(num_users, num_items, rank, interactions_per_user) < 1 or noise_sigma < 0:
    raise DataError("planted_interactions needs num_users, num_items, rank and "
                    "interactions_per_user >= 1 and noise_sigma >= 0.")
  if interactions_per_user > num_items:
    raise DataError(f"interactions_per_user {interactions_per_user} is more than the "
                    f"{num_items} items; a user interacts with each item at most once.")
  rng = np.random.default_rng(seed)
  factor_std = rank ** -0.25
  truth = PlantedModel(
      mean=float(mean),
      user_bias=rng.normal(0, bias_sigma, num_users),
      item_bias=rng.normal(0, bias_sigma, num_items),
      user_factors=rng.normal(0, factor_std, (num_users, rank)),
      item_factors=rng.normal(0, factor_std, (num_items, rank)),
      noise_sigma=float(noise_sigma))
  chunk = max(1, 2**22 // num_items)  # users per block: bounded memory for large catalogues
  kth = interactions_per_user - 1
  items = []
  for start in range(0, num_users, chunk):
    users = np.arange(start, min(start + chunk, num_users))
    if implicit:
      noisy = (truth.item_bias[None, :] + truth.user_factors[users] @ truth.item_factors.T
               + rng.normal(0, noise_sigma, (len(users), num_items)))
      keys = -noisy  # the smallest keys are the top scores
    else:
      keys = rng.random((len(users), num_items))
    items.append(np.sort(np.argpartition(keys, kth, axis=1)[:, :interactions_per_user], axis=1))
  item = np.concatenate(items).reshape(-1).astype(np.int64)
  user = np.repeat(np.arange(num_users, dtype=np.int64), interactions_per_user)
  if implicit:
    label = np.ones(len(user), np.float32)
  else:
    label = (truth.predict(user, item) + rng.normal(0, noise_sigma, len(user))).astype(np.float32)
  frame = pd.DataFrame({"user": user, "item": item, "label": label,
                        "weight": np.ones(len(user), np.float32)})
  return frame, truth
