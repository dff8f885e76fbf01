;; A component that is not a WASI command: it exports a function, not `wasi:cli/run`.
(component
  (core module $m (func (export "answer") (result i32) i32.const 42))
  (core instance $i (instantiate $m))
  (func (export "answer") (result s32) (canon lift (core func $i "answer"))))
