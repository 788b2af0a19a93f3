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

# Layers one mode builds at once (builds.EarlyBuilds; decode --build-layers); 0, the default: auto
# (builds.layers_at_once: enough layers for an index per thread of the budget, at least MIN_LAYERS_AT_ONCE, so that
# the next layer's heads fill the threads as one ends). On the H200 host's 16 cores Gemma-3's three layers at once
# (four heads each) built in 4.2 s against 5.9 s two at a time; SmolLM2's eight at once (nine heads each) gained
# nothing (BENCHMARKS "The CUDA path, a third lease").
LAYERS_AT_ONCE = 0
MIN_LAYERS_AT_ONCE = 2

# A mode that failed on this many samples in a row is left out of the rest (decode --give-up-after): a broken plugin
# fails every sample, and with builds during the prefill each try costs a prefill of its own; one sample's failure
# alone does not end it.
GIVE_UP_AFTER = 2
