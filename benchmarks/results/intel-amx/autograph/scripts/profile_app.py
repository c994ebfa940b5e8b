import cProfile, sys, runpy, os
out = sys.argv[1]; sys.argv = sys.argv[2:]
prof = cProfile.Profile()
real_exit = os._exit
def exit_after_dump(code):
    prof.disable(); prof.dump_stats(out); real_exit(code)
os._exit = exit_after_dump
prof.enable()
runpy.run_path(sys.argv[0], run_name="__main__")
