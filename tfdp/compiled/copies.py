"""Whether a copy of a model built outside the strategy's scope computes what the model does:
Keras copies a layer through its config and weights, which miss state set otherwise."""
from __future__ import annotations

from tfdp.errors import ConfigError


def check_clone_computes_alike(users_model, clone, x, caller: str) -> None:
  """A copy made in the scope must compute what the user's model does: Keras copies a layer
  through its config and weights, which miss state set otherwise (an attribute changed after
  construction, an adapted lookup table). Compared on a few of the user's examples."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  fix = ("build and compile the model under `with tfdp.make_strategy().scope():` (or pass a "
         "function that returns it), so that no copy is made")
  try:
    mine = keras.tree.flatten(users_model(x, training=False))
  except Exception:  # pylint: disable=broad-except  (your model's own fault: said where it runs)
    return
  try:
    theirs = keras.tree.flatten(clone(x, training=False))
  except Exception as e:  # pylint: disable=broad-except  (e.g. "Table not initialized")
    detail = (str(e).strip().splitlines() or [""])[0][:200]
    raise ConfigError(f"{caller}: the model was built outside the strategy's scope, and the copy "
                      f"made in it fails ({type(e).__name__}: {detail}); {fix}.") from None
  def alike(ours, copies) -> bool:
    for a, b in zip(ours, copies):
      a, b = (np.asarray(keras.ops.convert_to_numpy(t), np.float64) for t in (a, b))
      scale = max(1.0, float(np.nanmax(np.abs(a), initial=0.0))) if a.size else 1.0
      if a.shape != b.shape or not np.allclose(a, b, rtol=1e-3, atol=1e-3 * scale,
                                               equal_nan=True):
        return False
    return True
  def computes_otherwise(where: str) -> ConfigError:
    return ConfigError(f"{caller}: the model was built outside the strategy's scope, and the copy "
                       f"made in it computes other outputs{where} (a layer holds state its config "
                       f"and weights do not carry); {fix}.")
  if not alike(mine, theirs):
    raise computes_otherwise("")
  # In training too (a probe: an attribute used only when training, set after construction,
  # trained the copy without it), where the user's model is deterministic there (two calls
  # agree: no dropout or noise). Its variables (BatchNorm's moving statistics) are put back.
  kept = [(model, model.get_weights()) for model in (users_model, clone)]
  try:
    first, second = (keras.tree.flatten(users_model(x, training=True)) for _ in range(2))
    if alike(first, second) and not alike(first, keras.tree.flatten(clone(x, training=True))):
      raise computes_otherwise(" in training")
  except ConfigError:
    raise
  except Exception:  # pylint: disable=broad-except  (not comparable here: said where it runs)
    pass
  finally:
    for model, weights in kept:
      model.set_weights(weights)
