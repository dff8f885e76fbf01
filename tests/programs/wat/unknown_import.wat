;; Imports a function no host provides.
(module
  (import "env" "launch_missiles" (func $launch (param i32)))
  (func (export "_start") (call $launch (i32.const 1))))
