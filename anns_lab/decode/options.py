"""The decoder's option values that the command line needs before anything heavy loads (``anns-lab --help`` and
every other command import the decode command's options: importing them from the engine pulled in torch and
transformers, ~3.5 s before any command ran)."""

CALIBRATE_AUTO = "auto"  # the decoder's default target, and a bare ``--calibrate``'s: :func:`calibrate.auto_target` of the layer's keys

UNTIL_BUILT = ("wait", "exact")
UNTIL_BUILT_HELP = ("what an index mode's decode steps do while its layers' indexes are still building: wait for them "
                    "(the time to first token then counts the build not hidden behind the prefill), or attend each such "
                    "layer over its whole cache on the accelerator, as full attention does (the first token does not "
                    "wait; a layer's index serves from the step after its build ends, and the table counts the steps "
                    "before every layer's did)")

# Layers one mode builds at once by default (builds.EarlyBuilds; decode --build-layers): the next one's heads fill the
# threads as one ends. On a 16-core GPU host the serial parts of two layers in flight set the pace (BENCHMARKS "The CUDA
# path, measured again"); more there is not measured yet.
LAYERS_AT_ONCE = 2
