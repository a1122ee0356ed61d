"""The score modes' shared matrix (kvpress's ``default_presses``): each mode at a few values,
alone and combined, that the generic tests run over."""
from h2o_vllm.score_modes import Decay, ObsWindow, Pooling, Score

#: name -> the modes a budget runs with.
MODES = {
    "decay-0.9": (Decay(0.9),),
    "decay-0.5": (Decay(0.5),),
    "window-1": (ObsWindow(1),),
    "window-5": (ObsWindow(5),),
    "pool-3": (Pooling(3),),
    "pool-15": (Pooling(15),),
    "decay+window+pool": (Decay(0.8), ObsWindow(3), Pooling(5)),
    "keydiff": (Score("keydiff"),),
    "keydiff+pool": (Pooling(5), Score("keydiff")),
}

#: (num_computed, query_len, prompt_len, prefill_chunk): prompts whole and in chunks, a step
#: straddling a window, decode steps, one past a chunked prompt.
STEPS = [(0, 12, 12, None), (4, 6, 12, None), (0, 5, 11, 4), (8, 3, 11, 4), (12, 1, 12, None),
         (20, 1, 11, 4), (2, 1, 7, None)]
