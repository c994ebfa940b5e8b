"""Exact ranking metrics over all items (recall@k, NDCG@k) as (numerator, denominator) sums, in
numpy and in TensorFlow (imported when called), with one tie rule: the lower item index first.
"""
from __future__ import annotations

import math

import numpy as np


def _ranking_inputs(scores, positives_mask, exclude_mask, k):
  scores = np.asarray(scores, np.float64)
  positives = np.asarray(positives_mask, bool)
  if scores.ndim != 2 or positives.shape != scores.shape:
    raise ValueError(f"scores and positives_mask must both be [users, items]; got {scores.shape} "
                     f"and {positives.shape}.")
  if k < 1:
    raise ValueError(f"k is {k}; give k >= 1.")
  if not np.all(np.isfinite(scores)):
    raise ValueError("scores hold NaN or inf; a model whose scores are not finite cannot be "
                     "ranked (did training diverge?).")
  if exclude_mask is not None:
    excluded = np.asarray(exclude_mask, bool)
    if excluded.shape != scores.shape:
      raise ValueError(f"exclude_mask is {excluded.shape}, scores {scores.shape}; give one shape.")
    scores = np.where(excluded, -np.inf, scores)
    positives = positives & ~excluded
  return scores, positives


def top_k_items(scores: np.ndarray, k: int) -> np.ndarray:
  """[users, min(k, items)] item indices by score, highest first; ties go to the lower index
  (as tf.math.top_k), so the numpy and TF metrics agree exactly. O(items) per user plus a sort
  of k: no full sort of the catalogue."""
  scores = np.asarray(scores)
  num_users, num_items = scores.shape
  top = min(k, num_items)
  if top == num_items:
    candidates = np.broadcast_to(np.arange(num_items), scores.shape)
  else:
    kth = -np.partition(-scores, top - 1, axis=1)[:, top - 1:top]  # the top-th largest score
    above, equal = scores > kth, scores == kth
    room = top - above.sum(axis=1, keepdims=True)  # ties at the cut: the lowest indices fill it
    chosen = above | (equal & (np.cumsum(equal, axis=1) <= room))
    candidates = np.nonzero(chosen)[1].reshape(num_users, top)  # ascending index in each row
  order = np.argsort(-np.take_along_axis(scores, candidates, axis=1), axis=1, kind="stable")
  return np.take_along_axis(candidates, order, axis=1)


def ranking_sums(scores, positives_mask, exclude_mask=None, k: int = 10) -> dict:
  """Exact recall@k and NDCG@k over ALL items for a batch of users, as sums to add across
  batches and workers: {"recall_at_k": (numerator, denominator), "ndcg_at_k": (...)}.

  scores [users, items] (finite); positives_mask [users, items]: the held-out items each user
  interacted with; exclude_mask: items not to rank (e.g. the user's training items), placed
  below every other item and never counted as positives.
  recall@k = hits in the top k / min(k, number of positives) (the capped recall of Liang et al.
  2018, so a user with more than k positives can reach 1); NDCG@k = DCG@k / ideal DCG@k with
  binary gains and discount 1/log2(rank + 1). Numerators sum per-user values; the denominator of
  both is the number of users with at least one positive, so padding users (all-zero rows) and
  users with nothing held out count for nothing. Ties go to the lower item index.
  """
  scores, positives = _ranking_inputs(scores, positives_mask, exclude_mask, k)
  top = top_k_items(scores, k)
  hits = np.take_along_axis(positives, top, axis=1)
  num_positives = positives.sum(axis=1)
  discounts = 1.0 / np.log2(np.arange(2, top.shape[1] + 2))
  ideal = np.concatenate([[0.0], np.cumsum(discounts)])[np.minimum(num_positives, top.shape[1])]
  has_positive = num_positives > 0
  recall = hits.sum(axis=1) / np.maximum(np.minimum(num_positives, k), 1)
  ndcg = (hits @ discounts) / np.where(has_positive, ideal, 1.0)
  users = float(has_positive.sum())
  return {f"recall_at_{k}": (float(recall[has_positive].sum()), users),
          f"ndcg_at_{k}": (float(ndcg[has_positive].sum()), users)}


def ranking_sums_tf(scores, positives_mask, exclude_mask=None, k: int = 10) -> dict:
  """`ranking_sums` in TensorFlow (float32), for a task's metric_sums inside a tf.function:
  the same definitions and tie rule (tf.math.top_k puts the lower index first). Scores must be
  finite; this is not checked here."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  scores = tf.cast(scores, tf.float32)
  positives = tf.cast(positives_mask, tf.bool)
  if exclude_mask is not None:
    excluded = tf.cast(exclude_mask, tf.bool)
    scores = tf.where(excluded, tf.constant(-np.inf, tf.float32), scores)
    positives = tf.logical_and(positives, tf.logical_not(excluded))
  num_items = scores.shape[-1]
  top = min(k, num_items) if num_items is not None else tf.minimum(k, tf.shape(scores)[-1])
  _, indices = tf.math.top_k(scores, k=top, sorted=True)
  hits = tf.cast(tf.gather(positives, indices, batch_dims=1), tf.float32)
  num_positives = tf.reduce_sum(tf.cast(positives, tf.int32), axis=1)
  ranks = tf.cast(tf.range(2, top + 2), tf.float32)
  discounts = math.log(2.0) / tf.math.log(ranks)
  ideal_by_count = tf.concat([[0.0], tf.cumsum(discounts)], axis=0)
  ideal = tf.gather(ideal_by_count, tf.minimum(num_positives, top))
  has_positive = num_positives > 0
  recall = tf.reduce_sum(hits, axis=1) / tf.cast(tf.maximum(tf.minimum(num_positives, k), 1),
                                                 tf.float32)
  ndcg = tf.reduce_sum(hits * discounts, axis=1) / tf.where(has_positive, ideal, 1.0)
  zeros = tf.zeros_like(recall)
  users = tf.reduce_sum(tf.cast(has_positive, tf.float32))
  return {f"recall_at_{k}": (tf.reduce_sum(tf.where(has_positive, recall, zeros)), users),
          f"ndcg_at_{k}": (tf.reduce_sum(tf.where(has_positive, ndcg, zeros)), users)}
