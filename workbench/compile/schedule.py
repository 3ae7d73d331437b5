def build_schedule(prog):
    return None
