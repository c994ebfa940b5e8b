"""The tfdp-* command-line apps; pyproject.toml's console scripts call each one's run()."""
import sys

from absl import flags


def lend_help_to_console_script(app_module_name: str) -> None:
  """absl's --help prints __main__'s docstring and the flags of the module named sys.argv[0]. An
  installed script (tfdp-train → apps.train:run) is a wrapper __main__ with neither, so --help
  showed a bare USAGE line: give it the app's docstring and flags."""
  app_module = sys.modules[app_module_name]
  main_module = sys.modules["__main__"]
  if main_module is app_module:  # run as `python apps/train.py`: absl finds both itself
    return
  main_module.__doc__ = app_module.__doc__
  for flag in flags.FLAGS.get_key_flags_for_module(app_module_name):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
