import faulthandler, sys
from tests.runtime import test_landing_transfer as m

def test_rep(rig_factory):
    faulthandler.dump_traceback_later(3.0, file=sys.stderr)
    try:
        m.test_a_pool_smaller_than_two_rooms_makes_the_second_wait(rig_factory)
    finally:
        faulthandler.cancel_dump_traceback_later()
