import sys; sys.path[:0] = [".", "/tmp/vendor"]
import calc, tinystats
assert calc.mean([1, 2, 3]) == 2
assert tinystats.median([3, 1, 2]) == 2
print("tests pass")
