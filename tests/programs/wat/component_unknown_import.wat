;; A component importing an interface no Strata linker provides.
(component
  (import "strata:test/missiles@1.0.0" (instance $missiles (export "launch" (func))))
  (core module $m)
  (core instance (instantiate $m)))
